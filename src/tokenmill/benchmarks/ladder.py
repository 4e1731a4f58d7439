"""The optimization ladder: one workload through a list of engine configs, each changing one toggle.

Every rung must produce the first rung's greedy tokens for every request; a rung that does not is not
reported (the mismatch is printed and the command exits non-zero). HF ``generate`` at ``--batch-size`` runs
the same workload in the same process as the peer. Writes ladder.md, ladder.json and ladder.png.

    python -m tokenmill.benchmarks.ladder [--model PATH] [--num-requests 32] [--batch-size 8]

New optimizations add a ``Rung`` to ``RUNGS``: a name and a function deriving its config from the previous.
"""

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.benchmarks import common
from tokenmill.benchmarks.hf_peer import HFPeer, build_hf_peer
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
    fmt_bytes,
    fmt_ms,
    fmt_rate,
    fmt_ratio,
    header_lines,
    markdown_table,
    write_json,
)
from tokenmill.benchmarks.workload import Workload, WorkloadSpec, parse_length_range
from tokenmill.config import FUSED_KERNEL_TOGGLES, EngineConfig
from tokenmill.loading import LoadedModel

BASELINE_RUNG = "contiguous KV"  # sequential serving with a KV cache: the baseline the targets refer to


@dataclass(frozen=True)
class LadderSetup:
    """What a rung may size itself by."""

    batch_size: int
    num_requests: int
    max_model_len: int
    block_size: int


@dataclass(frozen=True)
class Rung:
    name: str
    change: str  # the one toggle this rung changes, for the report
    configure: Callable[[EngineConfig, LadderSetup], EngineConfig]  # previous rung's config -> this one's
    cuda_only: bool = False  # GPU fast-path rungs: Triton kernels and CUDA graphs need a CUDA device


def _recompute(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(kv_cache="none", batching="sequential")


def _contiguous(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(kv_cache="contiguous")


def _static(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(batching="static", max_num_seqs=setup.batch_size)


def _continuous(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(batching="continuous")


def _paged(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    # The same KV memory as the contiguous rung (batch_size whole contexts), cut into blocks; with it,
    # more sequences than batch_size fit at once, so the sequence cap is lifted to the whole workload.
    blocks = setup.batch_size * setup.max_model_len // setup.block_size
    return config.with_options(kv_cache="paged", num_kv_blocks=blocks, max_num_seqs=setup.num_requests)


def _triton_attention(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(attention_backend="triton")


def _fused_kernels(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(**dict.fromkeys(FUSED_KERNEL_TOGGLES, True))


def _cuda_graphs(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(cuda_graphs=True)


def _programmatic_launch(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(programmatic_launch=None)  # on where the GPU supports it (Hopper+)


def _graph_logits(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(cuda_graph_logits=True)


def _overlap_decode(config: EngineConfig, setup: LadderSetup) -> EngineConfig:
    return config.with_options(overlap_decode=True)


RUNGS: list[Rung] = [
    Rung("recompute", "kv_cache=none, batching=sequential", _recompute),
    Rung("contiguous KV", "kv_cache=contiguous", _contiguous),
    Rung("static batching", "batching=static, max_num_seqs=batch size", _static),
    Rung("continuous batching", "batching=continuous", _continuous),
    Rung("paged KV", "kv_cache=paged, same KV bytes as contiguous, max_num_seqs=N", _paged),
    Rung("Triton attention", "attention_backend=triton", _triton_attention, cuda_only=True),
    Rung(
        "fused kernels",
        "fused_rms_norm/rotary/activation/gemv/decode_rotary_kv/sampling=True",
        _fused_kernels,
        cuda_only=True,
    ),
    Rung("CUDA graphs", "cuda_graphs=True (decode steps replayed)", _cuda_graphs, cuda_only=True),
    Rung(
        "logits in graphs",
        "cuda_graph_logits=True (LM head + argmax replayed)",
        _graph_logits,
        cuda_only=True,
    ),
    Rung("overlapped decode", "overlap_decode=True", _overlap_decode, cuda_only=True),
    Rung(
        "programmatic launch",
        "programmatic_launch=auto (on for Hopper+)",
        _programmatic_launch,
        cuda_only=True,
    ),
]


def rung_configs(
    base: EngineConfig, setup: LadderSetup, rungs: Sequence[Rung]
) -> list[tuple[Rung, EngineConfig]]:
    configs = []
    config = base
    for rung in rungs:
        config = rung.configure(config, setup)
        configs.append((rung, config))
    return configs


# -- measuring ------------------------------------------------------------------------------------------


def measure_rung(
    name: str, config: EngineConfig, loaded: LoadedModel, workload: Workload, show_progress: bool
) -> RunResult:
    return measure_engine(config, loaded, workload, name, show_progress)


def measure_hf(peer: HFPeer, workload: Workload, batch_size: int, show_progress: bool) -> RunResult:
    name = f"HF generate (batch {batch_size})"
    peer.warm_up(workload)
    with progress_bar(workload.max_output_tokens, name, show_progress) as bar:
        return peer.run_static(workload, batch_size, progress=bar, label=name)


# -- the report -----------------------------------------------------------------------------------------


@dataclass
class LadderReport:
    header: list[str]
    rungs: list[tuple[Rung, EngineConfig, RunResult]]
    hf: RunResult | None
    hf_matches: int | None
    wall_s: float

    def best(self) -> tuple[Rung, RunResult]:
        rung, _, result = max(self.rungs, key=lambda item: item[2].output_tokens_per_s)
        return rung, result

    def table(self) -> str:
        headers = ["rung", "change", "out tok/s", "TPOT mean ms", "TPOT p99 ms", "peak KV reserved",
                   "KV pool", "process mem peak", "vs prev", "vs first"]  # fmt: skip
        first = self.rungs[0][2].output_tokens_per_s
        rows, previous = [], None
        for rung, _, result in self.rungs:
            number = RUNGS.index(rung) + 1  # its place on the whole ladder, also when --rungs picks a few
            rows.append(_row(f"{number}. {rung.name}", rung.change, result, previous, first))
            previous = result.output_tokens_per_s
        if self.hf is not None:
            rows.append(_row(self.hf.label, "peer, static batches via generate", self.hf, None, first))
        return markdown_table(headers, rows)

    def summary(self) -> list[str]:
        lines = []
        best_rung, best = self.best()
        baseline = next((r for rung, _, r in self.rungs if rung.name == BASELINE_RUNG), None)
        if baseline is not None:
            ratio = best.output_tokens_per_s / baseline.output_tokens_per_s
            lines.append(f"- best rung '{best_rung.name}' over '{BASELINE_RUNG}' (sequential): {ratio:.2f}x")
        if self.hf is not None:
            ratio = best.output_tokens_per_s / self.hf.output_tokens_per_s
            lines.append(f"- best rung '{best_rung.name}' over {self.hf.label}: {ratio:.2f}x")
            total = len(self.hf.output_token_ids)
            lines.append(
                f"- HF greedy tokens equal to the first rung's for {self.hf_matches}/{total} requests"
            )
        first = self.rungs[0][0].name
        if len(self.rungs) > 1:
            count = len(best.output_token_ids)
            lines.append(f"- every rung's greedy tokens equal those of '{first}' for all {count} requests")
        else:
            lines.append(f"- only '{first}' was measured: no cross-rung token check")
        lines.append(f"- ladder wall time {self.wall_s:.1f} s (model load, warm-ups and all rungs)")
        return lines

    def markdown(self) -> str:
        notes = [
            "",
            "TPOT: per request (last token time - first token time) / (output tokens - 1); mean and p99 "
            "over requests. Peak KV reserved: the most KV bytes held by sequences at any step (0 without a "
            "cache); KV pool: bytes allocated for the cache. Process mem peak: resident-set high-water mark "
            "during the rung on CPU, torch.cuda.max_memory_allocated on CUDA (model weights included).",
        ]
        return "\n".join([*self.header, "", self.table(), "", *self.summary(), *notes]) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "header": self.header,
            "rungs": [_result_json(r, rung.name, rung.change, config) for rung, config, r in self.rungs],
            "hf": None if self.hf is None else _result_json(self.hf, self.hf.label, "peer", None),
            "hf_matching_requests": self.hf_matches,
            "wall_s": self.wall_s,
        }


def _row(name: str, change: str, result: RunResult, previous: float | None, first: float) -> list[str]:
    tok_s = result.output_tokens_per_s
    return [
        name,
        change,
        fmt_rate(tok_s),
        fmt_ms(result.tpot_mean_s()),
        fmt_ms(result.tpot_p99_s()),
        fmt_bytes(result.peak_kv_reserved_bytes),
        fmt_bytes(result.kv_pool_bytes),
        fmt_bytes(result.peak_memory_bytes),
        fmt_ratio(tok_s / previous if previous else None),
        fmt_ratio(tok_s / first),
    ]


def _result_json(result: RunResult, name: str, change: str, config: EngineConfig | None) -> dict[str, Any]:
    return {
        "name": name,
        "change": change,
        "config": None if config is None else config.options(),
        "output_tokens": result.num_output_tokens,
        "elapsed_s": result.elapsed_s,
        "output_tokens_per_s": result.output_tokens_per_s,
        "tpot_mean_s": result.tpot_mean_s(),
        "tpot_p99_s": result.tpot_p99_s(),
        "peak_kv_reserved_bytes": result.peak_kv_reserved_bytes,
        "kv_pool_bytes": result.kv_pool_bytes,
        "peak_memory_bytes": result.peak_memory_bytes,
        "steps": result.num_steps,
        **result.extra,
    }


def write_plot(report: LadderReport, path: Path) -> bool:
    """Bars of tok/s per rung (HF included) and of KV memory; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [rung.name for rung, _, _ in report.rungs]
    rates = [r.output_tokens_per_s for _, _, r in report.rungs]
    colors = ["tab:blue"] * len(names)
    if report.hf is not None:
        names, rates, colors = (
            [*names, report.hf.label],
            [*rates, report.hf.output_tokens_per_s],
            [*colors, "tab:gray"],
        )
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(13, 4.8))
    bars = speed.bar(range(len(names)), rates, color=colors)
    speed.bar_label(bars, fmt="%.1f")
    speed.set_xticks(range(len(names)), names, rotation=30, ha="right")
    speed.set_ylabel("output tokens / s")
    speed.set_title("throughput")
    _kv_panel(memory, report)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _kv_panel(axes: Any, report: LadderReport) -> None:
    names = [rung.name for rung, _, _ in report.rungs]
    mib = 2**20
    positions = list(range(len(names)))
    pool = [(r.kv_pool_bytes or 0) / mib for _, _, r in report.rungs]
    reserved = [(r.peak_kv_reserved_bytes or 0) / mib for _, _, r in report.rungs]
    axes.bar([p - 0.2 for p in positions], pool, width=0.4, label="KV pool allocated", color="tab:orange")
    axes.bar([p + 0.2 for p in positions], reserved, width=0.4, label="peak KV reserved", color="tab:green")
    axes.set_xticks(positions, names, rotation=30, ha="right")
    axes.set_ylabel("MiB")
    axes.set_title("KV cache memory")
    axes.legend()


# -- the command ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--num-requests", type=int, default=32)
    group.add_argument("--input-len-range", type=parse_length_range, default=(32, 96), metavar="MIN-MAX")
    group.add_argument("--output-len-range", type=parse_length_range, default=(16, 96), metavar="MIN-MAX")
    group.add_argument("--prompt-source", choices=("auto", "text", "random"), default="auto")
    group = parser.add_argument_group("ladder")
    group.add_argument(
        "--batch-size", type=int, default=8, help="static/continuous batch and HF batch (default 8)"
    )
    group.add_argument("--block-size", type=int, default=EngineConfig().kv.block_size)
    group.add_argument("--max-model-len", type=int, default=None, help="default: fit the workload")
    group.add_argument("--rungs", nargs="+", default=None, metavar="NAME", help=f"subset of: {_rung_names()}")
    group.add_argument("--report-dir", type=Path, default=None, help="default: reports/ladder-<device>")
    group.add_argument("--skip-hf", action="store_true", help="do not run the HF generate peer")


def _rung_names() -> str:
    return ", ".join(repr(rung.name) for rung in RUNGS)


def selected_rungs(names: Sequence[str] | None) -> list[Rung]:
    if names is None:
        return list(RUNGS)
    known = {rung.name: rung for rung in RUNGS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown rung(s) {unknown}; known: {_rung_names()}")
    # Configs still derive through every earlier rung, so a subset measures the same configs as the full run.
    return [rung for rung in RUNGS if rung.name in names]


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
    header = header_lines(
        "tokenmill optimization ladder", workload_text, hardware, describe_model(loaded), peer_text
    )
    report = LadderReport(header, results, hf_result, hf_matches, time.perf_counter() - started)
    print_report(report, hardware, args.report_dir)
    return 0


def ladder_configs(
    args: argparse.Namespace, loaded: LoadedModel, workload: Workload, max_model_len: int
) -> list[tuple[Rung, EngineConfig]]:
    setup = LadderSetup(args.batch_size, workload.num_requests, max_model_len, args.block_size)
    # Every fused kernel off at the start (their default is on with CUDA), so the GPU rungs add them.
    base = common.base_engine_config(args, loaded, max_model_len).with_options(
        block_size=args.block_size,
        programmatic_launch=False,
        cuda_graph_logits=False,
        **dict.fromkeys(FUSED_KERNEL_TOGGLES, False),
    )
    wanted = {rung.name for rung in selected_rungs(args.rungs)}
    if loaded.device.type != "cuda":
        wanted -= {rung.name for rung in RUNGS if rung.cuda_only}
    return [(rung, config) for rung, config in rung_configs(base, setup, RUNGS) if rung.name in wanted]


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


def print_report(report: LadderReport, hardware: Hardware, report_dir: Path | None) -> None:
    folder = report_dir or Path("reports") / f"ladder-{hardware.device.split(':')[0]}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ladder.md").write_text(report.markdown())
    write_json(folder / "ladder.json", report.to_json())
    plotted = write_plot(report, folder / "ladder.png")
    print("\n" + report.table() + "\n")
    print("\n".join(report.summary()))
    files = "ladder.md, ladder.json" + (", ladder.png" if plotted else " (no matplotlib: no ladder.png)")
    print(f"wrote {files} to {folder}")


def main(argv: list[str] | None = None) -> int:
    return common.run_as_script("ladder", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
