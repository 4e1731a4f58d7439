"""The frame of a scenarios run: its report header, and its end (the report written, failures said)."""

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from tokenmill.benchmarks.report import provenance
from tokenmill.benchmarks.scenarios.report import WorkloadResult, write_report
from tokenmill.benchmarks.scenarios.sizes import Sizes, flag_name

OFF_ON_BASELINE = (
    "each workload with its feature off, on the same engine, model and requests, measured in the same run "
    "just before the feature on"
)


def header_lines(
    args: argparse.Namespace, driver: str, model: str, preset: str, baseline: str = OFF_ON_BASELINE
) -> list[str]:
    """The title and what was run; the machine and date are in the provenance header above it."""
    overrides = [f"--{flag_name(f.name)}" for f in fields(Sizes) if getattr(args, f.name) is not None]
    return [
        "# tokenmill scheduling scenarios",
        "",
        f"- driver: {driver}",
        f"- model: {model}",
        f"- baseline: {baseline}",
        f"- sizes: preset {preset}" + (f", overridden by {' '.join(overrides)}" if overrides else ""),
    ]


def finish(
    results: Sequence[WorkloadResult],
    header: list[str],
    folder: Path,
    started: float,
    meta: dict[str, Any],
    machine: str,
) -> int:
    """Write the report (``machine``: what ran it, for its provenance), say what failed; non-zero when any
    outputs differed or any request failed."""
    wall = time.perf_counter() - started
    header = [*header, f"- wall time: {wall:.1f} s (model load, warm-ups, every workload off and on)"]
    written = write_report(folder, header, results, meta, provenance(machine))
    print(f"wrote {', '.join(path.name for path in written)} to {folder}")
    failed = False
    for result in results:
        if not result.outputs_match:
            failed = True
            count = len(result.mismatches)
            print(
                f"\nCORRECTNESS CHECK FAILED: {result.scenario.name}: greedy outputs differ off vs on for "
                f"{count} request(s); its numbers are not reported",
                file=sys.stderr,
            )
            for mismatch in result.mismatches[:5]:
                print(f"  {mismatch.request_id}: {mismatch.description}", file=sys.stderr)
        if result.failed_requests:
            failed = True
            print(f"{result.scenario.name}: {result.failed_requests} request(s) failed", file=sys.stderr)
    return 1 if failed else 0
