"""The ladder's report: a table of every rung (and the HF peer), a summary, a plot of throughput and KV
memory; written as ladder.md (with its provenance), ladder.json and ladder.png."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.benchmarks.ladder.rungs import BASELINE_RUNG, RUNGS, Rung
from tokenmill.benchmarks.measure import RunResult
from tokenmill.benchmarks.report import (
    Hardware,
    Provenance,
    fmt_bytes,
    fmt_ms,
    fmt_rate,
    fmt_ratio,
    markdown_table,
    provenance,
    pyplot,
    save_figure,
    write_json,
)
from tokenmill.config import EngineConfig


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

    def markdown(self, image: str | None = None) -> str:
        notes = [
            "",
            "TPOT: per request (last token time - first token time) / (output tokens - 1); mean and p99 "
            "over requests. Peak KV reserved: the most KV bytes held by sequences at any step (0 without a "
            "cache); KV pool: bytes allocated for the cache. Process mem peak: resident-set high-water mark "
            "during the rung on CPU, torch.cuda.max_memory_allocated on CUDA (model weights included).",
        ]
        plot = ["", f"![ladder]({image})"] if image else []
        return "\n".join([*self.header, "", self.table(), "", *self.summary(), *notes, *plot]) + "\n"

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


def write_plot(report: LadderReport, path: Path, origin: Provenance) -> bool:
    """Bars of tok/s per rung (HF included) and of KV memory; False when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
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
    save_figure(figure, path, 120, origin)
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


def write_report(report: LadderReport, hardware: Hardware, folder: Path) -> list[str]:
    """ladder.png (when matplotlib is there), ladder.md and ladder.json in ``folder``: the names written."""
    origin = provenance(hardware)
    folder.mkdir(parents=True, exist_ok=True)
    plotted = write_plot(report, folder / "ladder.png", origin)
    (folder / "ladder.md").write_text(origin.markdown() + report.markdown("ladder.png" if plotted else None))
    write_json(folder / "ladder.json", {"provenance": origin.to_json(), **report.to_json()})
    return ["ladder.md", "ladder.json", *(["ladder.png"] if plotted else [])]
