"""A scenario's feature off against on: identical greedy outputs, the on/off ratios, and its target.

Ratios are always on / off: below 1 is lower with the feature (good for TTFT and ITL), above 1 higher
(good for throughput).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.benchmarks.scenarios.traces import RunSummary, ScenarioRun

ITL_TAIL_LIMIT = 3.0  # chunked_prefill: ITL p99 within this multiple of its p50 with the feature on
TTFT_CUT = 2.0  # prefix_caching: TTFT p50 at least this many times lower with the feature on


@dataclass(frozen=True)
class OutputMismatch:
    request_id: str
    description: str


def compare_outputs(off: ScenarioRun, on: ScenarioRun) -> list[OutputMismatch]:
    """Requests whose output (token ids, or text over HTTP) differs between the two runs, or is missing."""
    off_traces, on_traces = off.by_id(), on.by_id()
    mismatches = []
    for request_id in sorted(set(off_traces) | set(on_traces)):
        if request_id not in off_traces or request_id not in on_traces:
            run = off.label if request_id not in off_traces else on.label
            mismatches.append(OutputMismatch(request_id, f"never sent in the '{run}' run"))
            continue
        expected, got = off_traces[request_id].output(), on_traces[request_id].output()
        if expected != got:
            mismatches.append(OutputMismatch(request_id, _difference(expected, got)))
    return mismatches


def _difference(expected: list[int] | str, got: list[int] | str, context: int = 4) -> str:
    position = next(
        (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
        min(len(expected), len(got)),
    )
    low, high = max(0, position - context), position + context + 1
    return (
        f"first difference at output position {position} (lengths {len(expected)} and {len(got)}): "
        f"off ...{expected[low:high]!r} on ...{got[low:high]!r}"
    )


def ratio(on: float, off: float) -> float:
    return on / off if off and not math.isnan(off) else math.nan


def ratios(off: RunSummary, on: RunSummary) -> dict[str, float]:
    """on / off for every reported metric."""
    values = {
        "output_tokens_per_s": ratio(on.output_tokens_per_s, off.output_tokens_per_s),
        "requests_per_s": ratio(on.requests_per_s, off.requests_per_s),
    }
    for name, off_stats, on_stats in (("ttft", off.ttft_s, on.ttft_s), ("itl", off.itl_s, on.itl_s)):
        for key in ("p50", "p90", "p99"):
            values[f"{name}_{key}"] = ratio(on_stats[key], off_stats[key])
    return values


@dataclass(frozen=True)
class TargetCheck:
    target: str
    met: bool
    evidence: str


def itl_tail_target(off: RunSummary, on: RunSummary) -> TargetCheck:
    on_tail = ratio(on.itl_s["p99"], on.itl_s["p50"])
    off_tail = ratio(off.itl_s["p99"], off.itl_s["p50"])
    return TargetCheck(
        f"with chunked prefill, ITL p99 within {ITL_TAIL_LIMIT:g}x its p50",
        on_tail <= ITL_TAIL_LIMIT,
        f"ITL p99 / p50 is {on_tail:.2f} on and {off_tail:.2f} off "
        f"(p50 {on.itl_s['p50'] * 1e3:.0f} ms on, {off.itl_s['p50'] * 1e3:.0f} ms off)",
    )


def ttft_cut_target(off: RunSummary, on: RunSummary) -> TargetCheck:
    cut = ratio(off.ttft_s["p50"], on.ttft_s["p50"])
    speedup = ratio(on.output_tokens_per_s, off.output_tokens_per_s)
    return TargetCheck(
        f"with prefix caching, TTFT p50 cut at least {TTFT_CUT:g}x and output throughput raised",
        cut >= TTFT_CUT and speedup > 1,
        f"TTFT p50 {cut:.2f}x lower ({off.ttft_s['p50'] * 1e3:.0f} -> {on.ttft_s['p50'] * 1e3:.0f} ms), "
        f"output tok/s {speedup:.2f}x ({off.output_tokens_per_s:.1f} -> {on.output_tokens_per_s:.1f})",
    )


TARGETS: dict[str, Callable[[RunSummary, RunSummary], TargetCheck]] = {
    "chunked_prefill": itl_tail_target,
    "prefix_caching": ttft_cut_target,
}


def check_target(workload: str, off: RunSummary, on: RunSummary) -> TargetCheck | None:
    check = TARGETS.get(workload)
    return None if check is None else check(off, on)
