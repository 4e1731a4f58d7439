"""Sum up a rank's profiler trace (:mod:`tokenmill.profiling`): where its GPU time goes per decoded token.

A trace holds every kernel the GPU ran (start and duration). From them: the window from the first kernel's
start to the last one's end, the time some kernel was running (their union), the idle gaps between
kernels by length (short ones are launch and dependency bubbles; long ones mean the GPU waited for the
host), and the kernel time by kind, from the kernels' names. A collective's time includes its wait for
the slowest rank, so the ranks' collective times tell their skew apart from the transfer itself.
"""

import dataclasses
import gzip
import itertools
import json
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from tokenmill.benchmarks.report import markdown_table

KINDS = (  # first match wins
    ("all-reduce", r"all_?reduce|one_shot|two_shot|multimem"),
    ("all-gather", r"all_?gather"),
    ("broadcast / other collective", r"broadcast|nccl|reduce_scatter"),
    ("attention", r"attention|attn|_decode_kernel|_prefill_kernel|merge_partitions|flash"),
    ("GEMV / GEMM", r"gemv|gemm|nvjet|cutlass|sm90_|sm80_|matmul|splitk|cublas"),
    ("RMSNorm", r"norm"),
    ("rotary + KV write", r"rotary|write_kv"),
    ("activation", r"activation|silu|gelu"),
    ("sampling", r"argmax|gumbel|sampl|topk|softmax|bitmask"),
    ("copies", r"memcpy|memset|copy|fill"),
)
GAP_BUCKETS_US = (2.0, 10.0, 50.0)


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    duration_us: float


@dataclasses.dataclass(frozen=True)
class TraceSummary:
    rank: int
    window_us: float
    busy_us: float
    kinds: dict[str, tuple[int, float]]  # kind -> (kernels, total µs)
    gaps: dict[str, float]  # gap bucket -> total µs
    top: list[tuple[str, int, float]]  # name, count, total µs: the longest kernels by total time
    collective_median_us: float | None  # of one all-reduce kernel


def read_kernels(path: Path) -> list[Kernel]:
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as handle:
        events = json.load(handle)["traceEvents"]
    kernels = [
        Kernel(event["name"], float(event["ts"]), float(event.get("dur", 0.0)))
        for event in events
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(kernels, key=lambda kernel: kernel.start_us)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def summarize(kernels: Sequence[Kernel], rank: int, top: int = 12) -> TraceSummary:
    if not kernels:
        return TraceSummary(rank, 0.0, 0.0, {}, {}, [], None)
    busy, gaps = _busy_and_gaps(kernels)
    kinds: dict[str, tuple[int, float]] = {}
    names: dict[str, tuple[int, float]] = {}
    for kernel in kernels:
        for table, key in ((kinds, kind_of(kernel.name)), (names, kernel.name)):
            count, total = table.get(key, (0, 0.0))
            table[key] = (count + 1, total + kernel.duration_us)
    longest = sorted(names.items(), key=lambda item: -item[1][1])[:top]
    reduces = [k.duration_us for k in kernels if kind_of(k.name) == "all-reduce"]
    window = max(k.start_us + k.duration_us for k in kernels) - kernels[0].start_us
    return TraceSummary(
        rank,
        window,
        busy,
        kinds,
        gaps,
        [(name, count, total) for name, (count, total) in longest],
        statistics.median(reduces) if reduces else None,
    )


def _busy_and_gaps(kernels: Sequence[Kernel]) -> tuple[float, dict[str, float]]:
    """The union of the kernels' spans, and the idle time between them by gap length."""
    labels = [f"< {GAP_BUCKETS_US[0]:g} µs"]
    labels += [f"{low:g}-{high:g} µs" for low, high in itertools.pairwise(GAP_BUCKETS_US)]
    labels.append(f"> {GAP_BUCKETS_US[-1]:g} µs")
    gaps = dict.fromkeys(labels, 0.0)
    busy, end = 0.0, kernels[0].start_us
    for kernel in kernels:
        finish = kernel.start_us + kernel.duration_us
        if kernel.start_us > end:
            gap = kernel.start_us - end
            index = sum(gap >= bound for bound in GAP_BUCKETS_US)
            gaps[labels[index]] += gap
        busy += max(0.0, finish - max(end, kernel.start_us))
        end = max(end, finish)
    return busy, gaps


def summarize_trace(path: Path, rank: int) -> TraceSummary:
    return summarize(read_kernels(path), rank)


def profile_tables(summaries: Sequence[TraceSummary], steps: int, label: str) -> list[str]:
    """Markdown: per decoded token (``steps`` of them in the window), each rank's time by kind and gap."""
    ranks = [f"rank {s.rank} µs/token" for s in summaries]
    rows = [
        ["window (first kernel to last)", *[f"{s.window_us / steps:.0f}" for s in summaries]],
        ["some kernel running", *[f"{s.busy_us / steps:.0f}" for s in summaries]],
    ]
    kinds = sorted(
        {kind for s in summaries for kind in s.kinds}, key=lambda k: -summaries[0].kinds.get(k, (0, 0))[1]
    )
    for kind in kinds:
        rows.append([f"kernels: {kind}", *[_per_step(s.kinds.get(kind), steps) for s in summaries]])
    for bucket in summaries[0].gaps:
        rows.append([f"idle gaps {bucket}", *[f"{s.gaps[bucket] / steps:.0f}" for s in summaries]])
    medians = [f"{s.collective_median_us:.1f}" if s.collective_median_us else "-" for s in summaries]
    rows.append(["median all-reduce kernel (µs, not per token)", *medians])
    note = (
        "Kernel times are summed per kind: kernels that overlap (programmatic launch starts one while the "
        "one before it finishes) count in full, so the sums can exceed the window."
    )
    lines = [f"### {label}", "", markdown_table(["", *ranks], rows), "", note, ""]
    for summary in summaries:
        top = [[name[:90], str(count), f"{total / steps:.1f}"] for name, count, total in summary.top]
        lines += [
            f"Longest kernels, rank {summary.rank}:",
            "",
            markdown_table(["kernel", "calls", "µs/token"], top),
            "",
        ]
    return lines


def _per_step(entry: tuple[int, float] | None, steps: int) -> str:
    if entry is None:
        return "-"
    count, total = entry
    return f"{total / steps:.0f} ({count / steps:.1f} calls)"
