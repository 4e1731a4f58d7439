"""The ``bench serve`` report: a table of every concurrency level, the scaling from 1 to the highest, a
plot of throughput and latency, written as serve.md (with its provenance), serve.json and serve.png."""

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.benchmarks.report import Provenance, markdown_table, pyplot, save_figure

METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
STATS = ("mean", "p50", "p90", "p99")


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def level_table(summaries: Sequence[dict[str, Any]]) -> str:
    """One row per concurrency level: completions, request and token rates, TTFT / TPOT / ITL stats."""
    headers = ["concurrency", "ok / failed", "req/s", "output tok/s"]
    headers += [f"{name} {stat} (ms)" for _, name in METRICS for stat in STATS]
    rows = []
    for s in summaries:
        row = [str(s["concurrency"]), f"{s['completed']} / {s['failed']}", _fmt(s["request_throughput"], 2)]
        row.append(_fmt(s["output_throughput"]))
        row += [_fmt(s[key][stat]) for key, _ in METRICS for stat in STATS]
        rows.append(row)
    return markdown_table(headers, rows)


def comparison_table(label: str, mine: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]]) -> str:
    """This run beside ``label``'s, at the levels both have: output tok/s and its ratio, ITL and TTFT p50."""
    theirs = {s["concurrency"]: s for s in other}
    headers = ["concurrency", "output tok/s", f"{label} output tok/s", f"ratio to {label}"]
    headers += ["ITL p50 (ms)", f"{label} ITL p50 (ms)", "TTFT p50 (ms)", f"{label} TTFT p50 (ms)"]
    rows = []
    for s in mine:
        peer = theirs.get(s["concurrency"])
        if peer is None:
            continue
        ratio = s["output_throughput"] / peer["output_throughput"] if peer["output_throughput"] else math.nan
        rows.append(
            [
                *(str(s["concurrency"]), _fmt(s["output_throughput"]), _fmt(peer["output_throughput"])),
                *(_fmt(ratio, 2), _fmt(s["itl_ms"]["p50"], 2), _fmt(peer["itl_ms"]["p50"], 2)),
                *(_fmt(s["ttft_ms"]["p50"]), _fmt(peer["ttft_ms"]["p50"])),
            ]
        )
    return f"Beside {label}:\n\n" + markdown_table(headers, rows)


def scaling_line(summaries: Sequence[dict[str, Any]]) -> str | None:
    by_level = {s["concurrency"]: s["output_throughput"] for s in summaries}
    if 1 not in by_level or len(by_level) < 2 or not by_level[1]:
        return None
    top = max(by_level)
    return (
        f"Output tok/s at concurrency {top} is {by_level[top] / by_level[1]:.2f}x that at concurrency 1 "
        f"({by_level[top]:.1f} vs {by_level[1]:.1f})."
    )


def write_report(
    report_dir: Path, payload: dict[str, Any], summaries: list[dict[str, Any]], origin: Provenance
) -> list[Path]:
    report_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (report_dir / f"serve.{ext}" for ext in ("json", "md", "png"))
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    plotted = plot(summaries, png_path, payload["model"], origin)
    md_path.write_text(origin.markdown() + _markdown(payload, summaries, png_path.name if plotted else None))
    return [json_path, md_path, *([png_path] if plotted else [])]


def _markdown(payload: dict[str, Any], summaries: list[dict[str, Any]], image: str | None) -> str:
    workload = payload["workload"]
    counts = "/".join(map(str, workload["num_prompts"]))
    lines = [
        "# tokenmill bench serve",
        "",
        f"- server: {payload['url']} (model `{payload['model']}`)",
        f"- workload: {counts} prompts per level, {workload['prompts']}, "
        f"max_tokens {workload['output_len']}, ignore_eos {workload['ignore_eos']}, "
        f"temperature {workload['temperature']}, request rate {workload['request_rate']}",
        "",
        level_table(summaries),
        "",
    ]
    for table in payload.get("comparisons", []):
        lines += [table, ""]
    scaling = scaling_line(summaries)
    if scaling:
        lines += [scaling, ""]
    if image:
        lines += [f"![bench serve]({image})", ""]
    return "\n".join(lines)


def plot(summaries: Sequence[dict[str, Any]], path: Path, model: str, origin: Provenance) -> bool:
    """Output tok/s and p50 latencies against concurrency; False (and a note) without matplotlib."""
    plt = pyplot()
    if plt is None:
        print("matplotlib is missing (pip install 'tokenmill[bench]'): no plot", file=sys.stderr)
        return False
    levels = [s["concurrency"] for s in summaries]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(levels, [s["output_throughput"] for s in summaries], marker="o")
    left.set(xscale="log", xlabel="concurrency", ylabel="output tokens / s", title="Throughput")
    for key, label in METRICS:
        right.plot(levels, [s[key]["p50"] for s in summaries], marker="o", label=f"{label} p50")
    right.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="Latency (p50)")
    right.legend()
    for axes in (left, right):
        axes.set_xticks(levels, [str(level) for level in levels])
        axes.grid(alpha=0.3)
    figure.suptitle(f"tokenmill bench serve: {model}")
    save_figure(figure, path, 120, origin)
    return True
