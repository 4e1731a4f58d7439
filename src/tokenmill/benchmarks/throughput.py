"""Offline throughput: N requests through tokenmill, and through HF generate in the same run.

Reports total output tokens/s and requests/s for each, and their ratio. Before reporting, the first
``--verify-requests`` requests are served again one at a time (batching=sequential, same KV mode): the
measured run's greedy tokens must equal those, or no number is reported. HF mismatches are warnings
(its left padding can flip near-ties).

    python -m tokenmill.benchmarks.throughput [--num-requests 32] [--input-len 64] [--output-len 64]
    python -m tokenmill.benchmarks.throughput --dataset nano-vllm --device cuda   # 256 requests, 100..1024
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks import common
from tokenmill.benchmarks.arguments import add_throughput_arguments as add_arguments
from tokenmill.benchmarks.correctness import check_fast_path
from tokenmill.benchmarks.hf_peer import HFPeer, PeerUnavailableError, build_hf_peer
from tokenmill.benchmarks.latency import decode_bytes_per_token, measure_copy_bandwidth
from tokenmill.benchmarks.measure import RunResult, compare_outputs, measure_engine, progress_bar
from tokenmill.benchmarks.report import (
    Hardware,
    describe_model,
    detect_hardware,
    fmt_bytes,
    header_lines,
    markdown_table,
    provenance,
    write_json,
)
from tokenmill.benchmarks.workload import DATASETS, Workload, WorkloadSpec
from tokenmill.config import EngineConfig
from tokenmill.engine.hardware_defaults import Platform, resolve_config
from tokenmill.loading import LoadedModel


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    if args.dataset is not None:
        preset = DATASETS[args.dataset]
        lengths = preset.length_range
        return WorkloadSpec(
            preset.num_requests, lengths, lengths, preset.seed, preset.ignore_eos, preset.prompt_source
        )
    if args.random_range is not None:
        input_len = output_len = (args.random_range[0], args.random_range[1])
    else:
        input_len, output_len = (args.input_len, args.input_len), (args.output_len, args.output_len)
    return WorkloadSpec(
        args.num_requests, input_len, output_len, args.seed, args.ignore_eos, args.prompt_source
    )


def verify(
    config: EngineConfig, loaded: LoadedModel, workload: Workload, measured: RunResult, count: int, show: bool
) -> list[str]:
    """The first ``count`` requests served one at a time must give the measured run's tokens."""
    if count == 0:
        return []
    subset = Workload(workload.spec, workload.requests[:count], workload.prompt_source, workload.vocab_size)
    reference = measure_engine(config.with_options(batching="sequential"), loaded, subset, "verify", show)
    measured_subset = RunResult(
        measured.label,
        {r.request_id: measured.output_token_ids[r.request_id] for r in subset.requests},
        {},
        measured.elapsed_s,
    )
    return [mismatch.describe() for mismatch in compare_outputs(reference, measured_subset)]


def run_hf(peer: HFPeer, workload: Workload, args: argparse.Namespace, show: bool) -> list[RunResult]:
    results = []
    peer.warm_up(workload)
    with progress_bar(workload.max_output_tokens, "HF generate", show) as bar:
        results.append(peer.run_static(workload, args.hf_batch_size, progress=bar))
    if args.hf_continuous:
        try:
            with progress_bar(workload.max_output_tokens, "HF generate_batch", show) as bar:
                results.append(peer.run_continuous(workload, progress=bar))
        except PeerUnavailableError as error:
            print(f"skipping HF continuous batching: {error}", file=sys.stderr)
    return results


def result_row(result: RunResult, reference: RunResult) -> list[str]:
    num_requests = len(result.output_token_ids)
    matching = num_requests - len(compare_outputs(reference, result))
    return [
        result.label,
        str(result.num_output_tokens),
        f"{result.elapsed_s:.2f}",
        f"{result.output_tokens_per_s:.1f}",
        f"{result.requests_per_s:.2f}",
        f"{matching}/{num_requests}",
    ]


# -- the command ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    loaded = common.load_for_args(args)
    workload = common.workload_for(workload_spec(args), loaded)
    max_model_len = common.fit_max_model_len(workload, loaded, args.max_model_len)
    config = common.base_engine_config(args, loaded, max_model_len).with_options(
        **common.engine_options(args)
    )
    show = not args.no_progress
    scheduler = resolve_config(config, Platform.detect(loaded.device), max_model_len).scheduler
    label = f"tokenmill ({config.kv.mode} KV, {scheduler.batching}, max_num_seqs {scheduler.max_running})"
    hardware = detect_hardware(loaded.device)
    print(f"workload: {workload.describe()}\nhardware: {hardware.describe()}", flush=True)
    check = check_fast_path(config, loaded, workload.prompts()[:4])
    print(check.describe(), flush=True)
    if not check.passed:
        print("CORRECTNESS CHECK FAILED: no numbers reported.", file=sys.stderr)
        return 1
    runs = [
        measure_engine(config, loaded, workload, _run_label(label, index, args.repeat), show)
        for index in range(1, max(1, args.repeat) + 1)
    ]
    ours, repeats = runs[0], runs[1:]
    # In bfloat16 a batch and a lone request may round differently and flip a near-tie; the float32 check
    # above already compared batched against one-at-a-time tokens, so this re-run is float32 only.
    verified = min(args.verify_requests, workload.num_requests) if loaded.dtype == torch.float32 else 0
    mismatches = verify(config, loaded, workload, ours, verified, show)
    if mismatches:
        print(
            "CORRECTNESS CHECK FAILED: batched tokens differ from sequential ones; no numbers reported.",
            file=sys.stderr,
        )
        print("\n".join(f"  {line}" for line in mismatches[:5]), file=sys.stderr)
        return 1
    peer = None if args.skip_hf else build_hf_peer(loaded)
    peers = [] if peer is None else run_hf(peer, workload, args, show)
    peer_text = "none (--skip-hf)" if peer is None else peer.describe()
    workload_text = f"{workload.describe()}; max_model_len {max_model_len}"
    header = header_lines("tokenmill throughput", workload_text, describe_model(loaded), peer_text)
    limit = limit_share(ours, workload, loaded, config.kv.kv_cache_dtype)
    report = render(header, ours, [*repeats, *peers], verified, limit, len(repeats))
    print("\n" + "\n".join(report[len(header) :]))
    if args.report_dir is not None:
        save(args.report_dir, report, ours, [*repeats, *peers], config, hardware)
    return 0


def limit_share(ours: RunResult, workload: Workload, loaded: LoadedModel, kv_cache_dtype: str) -> str:
    """Bytes the run had to read (weights once per step, each decoded token's KV context) over its time,
    as a share of the copy bandwidth measured now: how close to memory-bound the whole run was."""
    weights, kv_per_token = decode_bytes_per_token(loaded, 1, kv_cache_dtype)
    kv_read = sum(
        kv_per_token * (len(request.prompt_token_ids) + position)
        for request in workload.requests
        for position in range(len(ours.output_token_ids[request.request_id]))
    )
    moved = weights * ours.num_steps + kv_read
    bandwidth = measure_copy_bandwidth(loaded.device)
    share = moved / ours.elapsed_s / bandwidth
    return (
        f"bytes read: weights {fmt_bytes(weights)} x {ours.num_steps} steps + KV {fmt_bytes(kv_read)} "
        f"= {moved / ours.elapsed_s / 1e9:.0f} GB/s, {share:.1%} of the {bandwidth / 1e9:.0f} GB/s copy "
        "bandwidth measured now"
    )


def _run_label(label: str, index: int, repeat: int) -> str:
    return label if repeat <= 1 else f"{label}, run {index}"


def render(
    header: list[str], ours: RunResult, others: list[RunResult], verified: int, limit: str, repeats: int = 0
) -> list[str]:
    """``others`` are the later runs of tokenmill (the first ``repeats``), then the peers."""
    headers = ["engine", "output tokens", "seconds", "out tok/s", "req/s", "requests = tokenmill"]
    table = markdown_table(headers, [result_row(r, ours) for r in [ours, *others]])
    lines = [*header, "", table, ""]
    later, peers = others[:repeats], others[repeats:]
    if later:
        best = max(run.output_tokens_per_s for run in later)
        lines.append(
            f"- first run / best later run (fresh engines, one process): "
            f"{ours.output_tokens_per_s / best:.3f}"
        )
    for peer in peers:
        lines.append(
            f"- tokenmill / {peer.label}: {ours.output_tokens_per_s / peer.output_tokens_per_s:.2f}x"
        )
    note = f"first {verified} requests re-run alone: identical tokens" if verified else "float32 check above"
    lines.append(f"- correctness: {note}")
    lines.append(f"- {limit}")
    return lines


def save(
    folder: Path,
    report: list[str],
    ours: RunResult,
    peers: list[RunResult],
    config: EngineConfig,
    hardware: Hardware,
) -> None:
    origin = provenance(hardware)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "throughput.md").write_text(origin.markdown() + "\n".join(report) + "\n")
    results = [_result_json(result) for result in [ours, *peers]]
    payload = {
        "provenance": origin.to_json(),
        "report": report,
        "config": config.options(),
        "results": results,
    }
    write_json(folder / "throughput.json", payload)
    print(f"wrote throughput.md, throughput.json to {folder}")


def _result_json(result: RunResult) -> dict[str, Any]:
    return {
        "label": result.label,
        "output_tokens": result.num_output_tokens,
        "elapsed_s": result.elapsed_s,
        "output_tokens_per_s": result.output_tokens_per_s,
        "requests_per_s": result.requests_per_s,
        "tpot_mean_s": result.tpot_mean_s(),
        "peak_memory_bytes": result.peak_memory_bytes,
        **result.extra,
    }


def main(argv: list[str] | None = None) -> int:
    return common.run_as_script("throughput", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
