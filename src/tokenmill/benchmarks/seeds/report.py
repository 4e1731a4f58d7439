"""The four tables as Markdown, each beside the seed's published numbers, and one figure of all four."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.benchmarks.report import Provenance, fmt_bytes, fmt_ratio, markdown_table, pyplot, save_figure
from tokenmill.benchmarks.seeds.batch_scaling import BatchRow
from tokenmill.benchmarks.seeds.kv_memory import MemoryTable
from tokenmill.benchmarks.seeds.kv_speed import SpeedRow
from tokenmill.benchmarks.seeds.published import (
    seed_batch_line,
    seed_memory_line,
    seed_note,
    seed_serving_line,
    seed_speed_line,
)
from tokenmill.benchmarks.seeds.serving import ServingRow

SEED_COLUMN = "seed (A100)"


@dataclass
class SeedTables:
    speed: list[SpeedRow] = field(default_factory=list)
    batch: list[BatchRow] = field(default_factory=list)
    memory: MemoryTable | None = None
    serving: list[ServingRow] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)  # table -> the error that stopped it
    seconds: dict[str, float] = field(default_factory=dict)  # table -> its wall time
    roofline: "Roofline | None" = None


@dataclass(frozen=True)
class Roofline:
    """What bounds decoding: every step reads the weights once and each sequence's KV, at the copy
    bandwidth measured in the same run."""

    bandwidth_bytes_per_s: float
    weight_bytes: int  # read per decode step
    kv_bytes_per_token: int

    def share(self, tokens_per_s: float, batch_size: int, mean_context: float) -> float:
        """The share of the bandwidth a decode rate uses (1.0: memory-bound), prefill time counted too."""
        step_bytes = self.weight_bytes + batch_size * mean_context * self.kv_bytes_per_token
        return step_bytes * tokens_per_s / batch_size / self.bandwidth_bytes_per_s

    def describe(self) -> str:
        return (
            f"Share of copy bandwidth: (weights {fmt_bytes(self.weight_bytes)} + each sequence's KV at its "
            f"mean context) per step over the step's time, at {self.bandwidth_bytes_per_s / 1e9:.1f} GB/s "
            "measured by a device copy in this run; the time includes the prefill, so the share is a lower "
            "bound."
        )


def _rate(value: float) -> str:
    return f"{value:,.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def _share(roofline: Roofline | None, tokens_per_s: float, batch: int, prompt: int, generated: int) -> str:
    if roofline is None:
        return "-"
    return f"{roofline.share(tokens_per_s, batch, prompt + generated / 2):.1%}"


def speed_section(rows: list[SpeedRow], roofline: Roofline | None) -> list[str]:
    headers = ["varies", "prompt", "generated", "KV cache tok/s", "of copy BW", "recompute tok/s", "ratio",
               SEED_COLUMN]  # fmt: skip
    body = [
        [r.axis, str(r.prompt_len), str(r.gen_len), _rate(r.cached_tok_s),
         _share(roofline, r.cached_tok_s, 1, r.prompt_len, r.gen_len), _rate(r.recompute_tok_s),
         fmt_ratio(r.speedup), fmt_ratio(r.seed_speedup)]
        for r in rows
    ]  # fmt: skip
    title = "## 1. KV cache vs recompute (one request at a time)"
    notes = [roofline.describe(), ""] if roofline else []
    return [title, "", *notes, markdown_table(headers, body), "", seed_note(seed_speed_line())]


def batch_section(
    rows: list[BatchRow], memory_measured: str, roofline: Roofline | None, lengths: tuple[int, int]
) -> list[str]:
    headers = ["batch", "tok/s", "vs batch 1", "of copy BW", "peak memory", "KV used (peak)", "KV pool",
               "seed tok/s", "seed peak"]  # fmt: skip
    base = rows[0].run.tokens_per_s if rows else 1.0
    body = []
    for row in rows:
        run, seed = row.run, row.seed()
        body.append(
            [str(row.batch_size), _rate(run.tokens_per_s), fmt_ratio(run.tokens_per_s / base),
             _share(roofline, run.tokens_per_s, row.batch_size, *lengths),
             fmt_bytes(run.peak_memory_bytes), fmt_bytes(run.peak_kv_used_bytes),
             fmt_bytes(run.kv_pool_bytes),
             _rate(seed[0]) if seed else "-", seed[1] if seed else "-"]
        )  # fmt: skip
    note = f"Peak memory: {memory_measured}. Each batch's paged pool holds exactly that batch."
    table = markdown_table(headers, body)
    return ["## 2. Batch-size scaling", "", note, "", table, "", seed_note(seed_batch_line())]


def memory_section(table: MemoryTable) -> list[str]:
    headers = ["batch", "contiguous allocated", "contiguous", "paged pool", "paged used (peak)",
               "contiguous / paged used", "paged at once", "preemptions", "blocks needed / pool"]  # fmt: skip
    body = []
    for r in table.rows:
        ratio = r.contiguous_bytes / r.paged.peak_kv_used_bytes if r.paged.peak_kv_used_bytes else None
        contiguous = (
            r.contiguous_failure or f"ran, {r.contiguous.peak_running if r.contiguous else 0} at once"
        )
        body.append(
            [str(r.batch_size), fmt_bytes(r.contiguous_bytes), contiguous, fmt_bytes(r.paged.kv_pool_bytes),
             fmt_bytes(r.paged.peak_kv_used_bytes), fmt_ratio(ratio),
             f"{r.paged.peak_running}/{r.batch_size}",
             str(r.paged.preemptions), f"{r.paged_blocks_needed}/{r.paged_pool_blocks}"]
        )  # fmt: skip
    found = [
        f"- crossover: paged's pool is smaller than contiguous's slabs from batch {table.crossover() or '-'}",
        f"- contiguous runs out of memory at batch {table.contiguous_oom() or '- (not in the ladder)'} "
        f"(limit: {table.limit_text}; one slab {fmt_bytes(table.slab_bytes)})",
        f"- paged runs out of blocks at batch {table.paged_exhausted() or '- (not in the ladder)'} "
        f"(one block {fmt_bytes(table.block_bytes)})",
    ]
    text = markdown_table(headers, body)
    return ["## 3. Contiguous vs paged KV memory", "", text, "", *found, "", seed_note(seed_memory_line())]


def serving_section(rows: list[ServingRow]) -> list[str]:
    headers = ["users", "requests", "sequential req/s", "tok/s", "latency mean / p99 ms", "batched req/s",
               "tok/s", "latency mean / p99 ms", "ratio", SEED_COLUMN]  # fmt: skip
    body = [
        [str(r.users), str(r.batched.num_requests), f"{r.sequential.requests_per_s:.2f}",
         _rate(r.sequential.tokens_per_s),
         f"{_ms(r.sequential.latency_mean_s)} / {_ms(r.sequential.latency_p99_s)}",
         f"{r.batched.requests_per_s:.2f}", _rate(r.batched.tokens_per_s),
         f"{_ms(r.batched.latency_mean_s)} / {_ms(r.batched.latency_p99_s)}", fmt_ratio(r.speedup),
         fmt_ratio(r.seed_speedup)]
        for r in rows
    ]  # fmt: skip
    return ["## 4. Serving by concurrent users (sequential vs continuous batching)", "",
            markdown_table(headers, body), "", seed_note(seed_serving_line())]  # fmt: skip


def render(
    tables: SeedTables, intro: list[str], memory_measured: str, batch_lengths: tuple[int, int] = (0, 0)
) -> str:
    lines = [*intro, ""]
    if tables.speed:
        lines += [*speed_section(tables.speed, tables.roofline), ""]
    if tables.batch:
        lines += [*batch_section(tables.batch, memory_measured, tables.roofline, batch_lengths), ""]
    if tables.memory is not None:
        lines += [*memory_section(tables.memory), ""]
    if tables.serving:
        lines += [*serving_section(tables.serving), ""]
    for name, error in tables.failures.items():
        lines += [f"## {name}: FAILED", "", f"    {error}", ""]
    return "\n".join(lines)


def plot(tables: SeedTables, path: Path, title: str, origin: Provenance) -> bool:
    """One figure, a panel per table measured; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(2, 2, figsize=(12, 9))
    _plot_speed(axes[0][0], tables.speed)
    _plot_batch(axes[0][1], tables.batch)
    _plot_memory(axes[1][0], tables.memory)
    _plot_serving(axes[1][1], tables.serving)
    figure.suptitle(title, fontsize=10)
    save_figure(figure, path, 110, origin)
    return True


def _plot_speed(axis: object, rows: list[SpeedRow]) -> None:
    ax: Any = axis
    by_gen = [r for r in rows if r.axis == "generation length"]
    ax.set_title("1. KV cache vs recompute (by generation length)")
    if by_gen:
        lengths = [r.gen_len for r in by_gen]
        ax.plot(lengths, [r.cached_tok_s for r in by_gen], "o-", label="KV cache")
        ax.plot(lengths, [r.recompute_tok_s for r in by_gen], "s-", label="recompute")
        ax.set_xlabel("generated tokens")
        ax.set_ylabel("tok/s")
        ax.legend()


def _plot_batch(axis: object, rows: list[BatchRow]) -> None:
    ax: Any = axis
    ax.set_title("2. batch scaling")
    if rows:
        batches = [r.batch_size for r in rows]
        ax.loglog(batches, [r.run.tokens_per_s for r in rows], "o-", label="tok/s")
        ax.loglog(batches, [r.run.peak_kv_used_bytes / 2**20 for r in rows], "^--", label="KV used MiB")
        ax.set_xlabel("batch size")
        ax.legend()


def _plot_memory(axis: object, table: MemoryTable | None) -> None:
    ax: Any = axis
    ax.set_title("3. contiguous vs paged KV memory")
    if table is not None:
        batches = [r.batch_size for r in table.rows]
        ax.loglog(
            batches, [r.contiguous_bytes / 2**20 for r in table.rows], "o-", label="contiguous allocated"
        )
        ax.loglog(batches, [r.paged.kv_pool_bytes / 2**20 for r in table.rows], "-", label="paged pool")
        ax.loglog(batches, [max(r.paged.peak_kv_used_bytes, 1) / 2**20 for r in table.rows], "s-",
                  label="paged used")  # fmt: skip
        if table.contiguous_oom():
            ax.axvline(table.contiguous_oom(), color="red", linestyle=":", label="contiguous out of memory")
        ax.set_xlabel("batch size")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=8)


def _plot_serving(axis: object, rows: list[ServingRow]) -> None:
    ax: Any = axis
    ax.set_title("4. serving by concurrent users")
    if rows:
        users = [r.users for r in rows]
        ax.plot(users, [r.sequential.tokens_per_s for r in rows], "o-", label="sequential")
        ax.plot(users, [r.batched.tokens_per_s for r in rows], "s-", label="continuous batching")
        ax.set_xlabel("concurrent users")
        ax.set_ylabel("tok/s")
        ax.legend()
