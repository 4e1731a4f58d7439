"""The scenario report: per workload a table (feature off, on, on / off), the target, the output check;
written as scenarios.md, scenarios.json and one PNG per workload.

A workload whose greedy outputs differ between off and on gets no numbers, only the differences.
"""

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.benchmarks.report import Provenance, markdown_table, pyplot, save_figure, write_json
from tokenmill.benchmarks.scenarios.compare import (
    OutputMismatch,
    TargetCheck,
    check_target,
    compare_outputs,
    ratios,
)
from tokenmill.benchmarks.scenarios.traces import RunSummary, ScenarioRun, summarize
from tokenmill.benchmarks.scenarios.workloads import Scenario
from tokenmill.config import EngineConfig

MAX_MISMATCHES_SHOWN = 5
QUANTILE_KEYS = ("p50", "p90", "p99")


@dataclass
class MeasuredConfig:
    label: str  # as the report shows it: "static", "prefix caching on", a URL
    config: EngineConfig | None  # None for a server given by URL
    run: ScenarioRun
    summary: RunSummary = field(init=False)

    def __post_init__(self) -> None:
        self.summary = summarize(self.run)


@dataclass
class WorkloadResult:
    scenario: Scenario
    feature: str | None  # None when a single server was measured
    change: str  # what differs between the configs
    measured: list[MeasuredConfig]  # [off, on], or one
    mismatches: list[OutputMismatch] = field(init=False)

    def __post_init__(self) -> None:
        pair = self.off_on()
        self.mismatches = compare_outputs(pair[0].run, pair[1].run) if pair else []

    def off_on(self) -> tuple[MeasuredConfig, MeasuredConfig] | None:
        return (self.measured[0], self.measured[1]) if len(self.measured) == 2 else None

    @property
    def outputs_match(self) -> bool:
        return not self.mismatches

    @property
    def failed_requests(self) -> int:
        return sum(m.summary.failed for m in self.measured)

    def ratios(self) -> dict[str, float] | None:
        pair = self.off_on()
        return ratios(pair[0].summary, pair[1].summary) if pair else None

    def target(self) -> TargetCheck | None:
        pair = self.off_on()
        return check_target(self.scenario.name, pair[0].summary, pair[1].summary) if pair else None


# -- markdown ---------------------------------------------------------------------------------------------

HEADERS = [
    "config", "ok / failed", "out tok/s", "req/s",
    *(f"TTFT {q} ms" for q in QUANTILE_KEYS), *(f"ITL {q} ms" for q in QUANTILE_KEYS),
    "cached prompt tokens", "steps", "preemptions",
]  # fmt: skip


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _row(measured: MeasuredConfig) -> list[str]:
    s = measured.summary
    cached = "-" if s.cached_prompt_tokens is None else f"{s.cached_prompt_tokens} of {s.prompt_tokens}"
    steps = measured.run.num_steps
    return [
        measured.label,
        f"{s.requests - s.failed} / {s.failed}",
        f"{s.output_tokens_per_s:.1f}",
        f"{s.requests_per_s:.2f}",
        *(_ms(s.ttft_s[q]) for q in QUANTILE_KEYS),
        *(_ms(s.itl_s[q]) for q in QUANTILE_KEYS),
        cached,
        "-" if steps is None else str(steps),
        str(measured.run.extra.get("preemptions", "-")),
    ]


def _ratio_row(values: dict[str, float]) -> list[str]:
    return [
        "on / off",
        "",
        _ratio(values["output_tokens_per_s"]),
        _ratio(values["requests_per_s"]),
        *(_ratio(values[f"ttft_{q}"]) for q in QUANTILE_KEYS),
        *(_ratio(values[f"itl_{q}"]) for q in QUANTILE_KEYS),
        "",
        "",
        "",
    ]


def table(result: WorkloadResult) -> str:
    rows = [_row(measured) for measured in result.measured]
    values = result.ratios()
    if values is not None:
        rows.append(_ratio_row(values))
    return markdown_table(HEADERS, rows)


def section(result: WorkloadResult, image: str | None = None) -> str:
    scenario = result.scenario
    title = scenario.name if result.feature is None else f"{scenario.name}: {result.feature} off vs on"
    lines = [
        f"## {title}",
        "",
        f"- workload: {scenario.description}",
        f"- configs differ in: {result.change}",
    ]
    if not result.outputs_match:
        return "\n".join([*lines, *_mismatch_lines(result)]) + "\n"
    lines += [*_check_lines(result), "", table(result), ""]
    if image:
        lines += [f"![{scenario.name}]({image})", ""]
    return "\n".join(lines)


def _check_lines(result: WorkloadResult) -> list[str]:
    lines = []
    if result.off_on() is not None:
        count = len(result.measured[0].run.traces)
        lines.append(f"- greedy outputs identical off and on for all {count} requests")
    target = result.target()
    if target is not None:
        verdict = "met" if target.met else "NOT met"
        lines.append(f"- target: {target.target}: **{verdict}**; {target.evidence}")
    if result.failed_requests:
        lines.append(f"- FAILED requests: {result.failed_requests} (not in the statistics)")
    return lines


def _mismatch_lines(result: WorkloadResult) -> list[str]:
    count = len(result.mismatches)
    lines = [
        "",
        f"**CORRECTNESS CHECK FAILED**: greedy outputs differ between off and on for {count} request(s); "
        "no numbers are reported for this workload.",
        "",
    ]
    lines += [f"- {m.request_id}: {m.description}" for m in result.mismatches[:MAX_MISMATCHES_SHOWN]]
    return [*lines, ""]


def document(header: Sequence[str], results: Sequence[WorkloadResult], notes: Sequence[str]) -> str:
    sections = [section(r, f"{r.scenario.name}.png" if r.outputs_match else None) for r in results]
    return "\n".join([*header, "", *sections, *notes]) + "\n"


NOTES = [
    "TTFT: from a request's release (its arrival, or for a later turn the arrival of the previous answer) "
    "to its first token. ITL: every gap between consecutive tokens of one request (over HTTP: between "
    "streamed chunks). Percentiles over all requests (TTFT) or all gaps (ITL) of the run. out tok/s and "
    "req/s: output tokens and requests over the time from the first arrival to the last token. Cached "
    "prompt tokens: prompt tokens served from the prefix cache (offline driver). The feature-off config "
    "runs first, then the feature-on config, each on a fresh engine after a short warm-up request.",
]


# -- JSON -------------------------------------------------------------------------------------------------


def to_json(result: WorkloadResult) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "workload": result.scenario.name,
        "description": result.scenario.description,
        "feature": result.feature,
        "change": result.change,
        "outputs_match": result.outputs_match,
        "mismatches": [m.__dict__ for m in result.mismatches],
    }
    if not result.outputs_match:
        return payload
    target = result.target()
    payload["configs"] = [_config_json(measured) for measured in result.measured]
    payload["on_over_off"] = result.ratios()
    payload["target"] = None if target is None else target.__dict__
    return payload


def _config_json(measured: MeasuredConfig) -> dict[str, Any]:
    return {
        "label": measured.label,
        "engine_config": None if measured.config is None else measured.config.options(),
        "summary": measured.summary.to_json(),
        "steps": measured.run.num_steps,
        **measured.run.extra,
        "requests": [
            {
                "id": trace.request_id,
                "prompt_tokens": len(trace.prompt_token_ids),
                "output_tokens": trace.num_output_tokens,
                "cached_prompt_tokens": trace.num_cached_tokens,
                "release_s": trace.release_time,
                "ttft_s": trace.ttft if trace.ok else None,
                # 0.1 ms is far below any gap measured; full float reprs made a 512-request report 10 MB.
                "token_times_s": [round(t, 4) for t in trace.token_times],
                "error": trace.error,
            }
            for trace in measured.run.traces
        ],
    }


# -- plot -------------------------------------------------------------------------------------------------


def write_plot(result: WorkloadResult, path: Path, origin: Provenance) -> bool:
    """TTFT and ITL percentiles, throughput, and every ITL over the run; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    _percentile_bars(axes[0][0], result, "ttft_s", "TTFT")
    _percentile_bars(axes[0][1], result, "itl_s", "ITL")
    _throughput_bars(axes[1][0], result)
    _itl_timeline(axes[1][1], result)
    figure.suptitle(f"{result.scenario.name}: {result.change}")
    save_figure(figure, path, 110, origin)
    return True


def _percentile_bars(axes: Any, result: WorkloadResult, key: str, name: str) -> None:
    width = 0.8 / len(result.measured)
    for index, measured in enumerate(result.measured):
        stats = getattr(measured.summary, key)
        positions = [q + index * width for q in range(len(QUANTILE_KEYS))]
        bars = axes.bar(positions, [stats[q] * 1e3 for q in QUANTILE_KEYS], width, label=measured.label)
        axes.bar_label(bars, fmt="%.0f", fontsize=8)
    axes.set_xticks([q + 0.4 - width / 2 for q in range(len(QUANTILE_KEYS))], list(QUANTILE_KEYS))
    axes.set(ylabel="ms", title=f"{name} percentiles")
    axes.legend()


def _throughput_bars(axes: Any, result: WorkloadResult) -> None:
    labels = [measured.label for measured in result.measured]
    rates = [measured.summary.output_tokens_per_s for measured in result.measured]
    bars = axes.bar(range(len(labels)), rates, color=[f"C{i}" for i in range(len(labels))])
    axes.bar_label(bars, fmt="%.1f")
    axes.set_xticks(range(len(labels)), labels)
    axes.set(ylabel="output tokens / s", title="throughput")


def _itl_timeline(axes: Any, result: WorkloadResult) -> None:
    for measured in result.measured:
        times, gaps = [], []
        for trace in measured.run.traces:
            times += trace.token_times[1:]
            gaps += [gap * 1e3 for gap in trace.itls]
        axes.scatter(times, gaps, s=4, alpha=0.5, label=measured.label)
    axes.set(xlabel="time in the run (s)", ylabel="ITL (ms)", yscale="log", title="every inter-token gap")
    axes.legend()


# -- files ------------------------------------------------------------------------------------------------


def write_report(
    folder: Path,
    header: Sequence[str],
    results: Sequence[WorkloadResult],
    meta: dict[str, Any],
    origin: Provenance,
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "scenarios.md", folder / "scenarios.json"]
    written[0].write_text(origin.markdown() + document(header, results, NOTES))
    payload = {
        "provenance": origin.to_json(),
        **meta,
        "header": list(header),
        "workloads": [to_json(r) for r in results],
    }
    write_json(written[1], payload, indent=None)  # one line: every token's time is in it
    plotted = [r for r in results if r.outputs_match]
    for result in plotted:
        png = folder / f"{result.scenario.name}.png"
        if not write_plot(result, png, origin):
            print("matplotlib is missing (pip install 'tokenmill[bench]'): no plots", file=sys.stderr)
            break
        written.append(png)
    return written
