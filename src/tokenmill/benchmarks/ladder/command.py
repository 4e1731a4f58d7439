"""The optimization ladder: one workload through a list of engine configs, each changing one toggle.

Every rung must produce the first rung's greedy tokens for every request; a rung that does not is not
reported (the mismatch is printed and the command exits non-zero). HF ``generate`` at ``--batch-size`` runs
the same workload in the same process as the peer. Writes ladder.md, ladder.json and ladder.png to
``--report-dir`` (default: ``$TOKENMILL_REPORT_DIR/ladder-<device>``, else
``~/.cache/tokenmill/reports/ladder-<device>``; never the source tree unless named).

    tokenmill bench ladder [--model PATH] [--num-requests 32] [--batch-size 8] [--report-dir DIR]

New optimizations add a ``Rung`` to ``RUNGS`` (``rungs``): a name and a function deriving its config from
the previous. ``command`` measures the rungs and checks their tokens; ``report`` writes the results.
"""

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tokenmill.benchmarks import common
from tokenmill.benchmarks.arguments import add_ladder_arguments as add_arguments
from tokenmill.benchmarks.hf_peer import HFPeer, build_hf_peer
from tokenmill.benchmarks.ladder.report import LadderReport, write_report
from tokenmill.benchmarks.ladder.rungs import (
    RUNGS,
    LadderSetup,
    Rung,
    rung_configs,
    selected_rungs,
)
from tokenmill.benchmarks.measure import (
    Mismatch,
    RunResult,
    compare_outputs,
    measure_engine,
    progress_bar,
)
from tokenmill.benchmarks.report import (
    Hardware,
    describe_model,
    detect_hardware,
    device_kind,
    header_lines,
    report_dir,
)
from tokenmill.benchmarks.workload import Workload, WorkloadSpec
from tokenmill.config import PLAIN_PATH, EngineConfig
from tokenmill.loading import LoadedModel


def measure_rung(
    name: str, config: EngineConfig, loaded: LoadedModel, workload: Workload, show_progress: bool
) -> RunResult:
    return measure_engine(config, loaded, workload, name, show_progress)


def measure_hf(peer: HFPeer, workload: Workload, batch_size: int, show_progress: bool) -> RunResult:
    name = f"HF generate (batch {batch_size})"
    peer.warm_up(workload)
    with progress_bar(workload.max_output_tokens, name, show_progress) as bar:
        return peer.run_static(workload, batch_size, progress=bar, label=name)


# -- the command ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    loaded = common.load_for_args(args)
    spec = WorkloadSpec(
        args.num_requests,
        args.input_len_range,
        args.output_len_range,
        args.seed,
        prompt_source=args.prompt_source,
    )
    workload = common.workload_for(spec, loaded)
    max_model_len = common.fit_max_model_len(workload, loaded, args.max_model_len)
    hardware = detect_hardware(loaded.device)
    workload_text = f"{workload.describe()}; max_model_len {max_model_len}, batch size {args.batch_size}"
    print(
        f"workload: {workload_text}\nhardware: {hardware.describe()}\nmodel: {describe_model(loaded)}",
        flush=True,
    )
    show = not args.no_progress
    results = [
        (rung, config, measure_rung(rung.name, config, loaded, workload, show))
        for rung, config in ladder_configs(args, loaded, workload, max_model_len)
    ]
    failures = check_rungs(results)
    if failures:
        print_failures(failures)
        return 1
    peer = None if args.skip_hf else build_hf_peer(loaded)
    hf_result, hf_matches = _run_peer(peer, workload, args.batch_size, results[0][2], show)
    peer_text = (
        "none (--skip-hf)" if peer is None else f"{peer.describe()}, static batches of {args.batch_size}"
    )
    header = header_lines("tokenmill optimization ladder", workload_text, describe_model(loaded), peer_text)
    report = LadderReport(header, results, hf_result, hf_matches, time.perf_counter() - started)
    print_report(report, hardware, args.report_dir)
    return 0


LADDER_TOKEN_BUDGET = 8192  # tokens per step on every rung (whole prompts: chunked prefill is not a rung)


def ladder_configs(
    args: argparse.Namespace, loaded: LoadedModel, workload: Workload, max_model_len: int
) -> list[tuple[Rung, EngineConfig]]:
    setup = LadderSetup(args.batch_size, workload.num_requests, max_model_len, args.block_size)
    # Every optimization off at the start (the defaults turn them on for the hardware): the rungs add them.
    base = common.base_engine_config(args, loaded, max_model_len).with_options(
        block_size=args.block_size,
        max_num_batched_tokens=max(LADDER_TOKEN_BUDGET, max_model_len),
        **PLAIN_PATH,
    )
    wanted = {rung.name for rung in selected_rungs(args.rungs)}
    # Off CUDA the GPU rungs are skipped, and the rungs after them derive without their toggles.
    runnable = [rung for rung in RUNGS if loaded.device.type == "cuda" or not rung.cuda_only]
    return [(rung, config) for rung, config in rung_configs(base, setup, runnable) if rung.name in wanted]


def _run_peer(
    peer: HFPeer | None, workload: Workload, batch_size: int, reference: RunResult, show: bool
) -> tuple[RunResult | None, int | None]:
    if peer is None:
        return None, None
    result = measure_hf(peer, workload, batch_size, show)
    mismatches = compare_outputs(reference, result)
    if mismatches:
        count = f"{len(mismatches)}/{workload.num_requests}"
        print(
            f"warning: HF generate differs from the first rung on {count} requests (padding and batch "
            f"shapes can flip near-ties in greedy decoding); first: {mismatches[0].describe()}",
            file=sys.stderr,
        )
    return result, workload.num_requests - len(mismatches)


def check_rungs(results: Sequence[tuple[Rung, EngineConfig, RunResult]]) -> dict[str, list[Mismatch]]:
    """Each rung's greedy tokens against the first rung's: {rung name: mismatches} for those that differ."""
    reference = results[0][2]
    failures = {}
    for rung, _, result in results[1:]:
        mismatches = compare_outputs(reference, result)
        if mismatches:
            failures[rung.name] = mismatches
    return failures


def print_failures(failures: dict[str, list[Mismatch]]) -> None:
    print("\nCORRECTNESS CHECK FAILED: no numbers are reported.", file=sys.stderr)
    for name, mismatches in failures.items():
        print(f"rung '{name}' differs from the first rung on {len(mismatches)} request(s):", file=sys.stderr)
        for mismatch in mismatches[:5]:
            print(f"  {mismatch.describe()}", file=sys.stderr)


def print_report(report: LadderReport, hardware: Hardware, given_dir: Path | None) -> None:
    folder = report_dir(given_dir, f"ladder-{device_kind(hardware)}")
    written = write_report(report, hardware, folder)
    print("\n" + report.table() + "\n")
    print("\n".join(report.summary()))
    missing = "" if "ladder.png" in written else " (no matplotlib: no ladder.png)"
    print(f"wrote {', '.join(written)} to {folder}{missing}")


def main(argv: list[str] | None = None) -> int:
    return common.run_as_script("ladder", __doc__, add_arguments, run, argv)
