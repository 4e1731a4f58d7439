"""``tokenmill bench scenarios``: argument parsing and the run, workload by workload."""

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks import common
from tokenmill.benchmarks.report import describe_model, detect_hardware, device_kind, provenance, report_dir
from tokenmill.benchmarks.scenarios.features import TOGGLES, config_difference
from tokenmill.benchmarks.scenarios.report import MeasuredConfig, WorkloadResult, section, write_report
from tokenmill.benchmarks.scenarios.sizes import PRESETS, Sizes, flag_name
from tokenmill.benchmarks.scenarios.traces import ScenarioRun
from tokenmill.benchmarks.scenarios.workloads import (
    WORKLOADS,
    Scenario,
    TokenSource,
    build_scenario,
    token_source,
)
from tokenmill.benchmarks.workload import parse_length_range
from tokenmill.config import EngineConfig
from tokenmill.loading import LoadedModel

ALL = "all"
DRIVERS = ("offline", "serve")
# (config, loaded, scenario, label, show progress) -> the run
Measure = Callable[[EngineConfig, LoadedModel, Scenario, str, bool], ScenarioRun]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser)
    group = parser.add_argument_group("scenarios")
    group.add_argument(
        "--workload",
        type=_workload_name,
        default=ALL,
        help=f"one of {', '.join(WORKLOADS)}, or all (default)",
    )
    group.add_argument("--driver", choices=DRIVERS, default="offline", help="default: offline (no HTTP)")
    group.add_argument(
        "--url",
        action="append",
        default=None,
        help="drive this server instead of starting one (implies --driver serve); give it twice, feature "
        "off then on, to compare two servers; --model is then the model name sent (default: the server's)",
    )
    group.add_argument("--api-key", default=None, help="with --url: sent as 'Authorization: Bearer KEY'")
    group.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request (serve driver)")
    group.add_argument(
        "--preset", choices=("auto", *PRESETS), default="auto", help="sizes: auto = gpu on CUDA, else cpu"
    )
    group.add_argument("--prompt-source", choices=("auto", "text", "random"), default="auto")
    group.add_argument(
        "--report-dir",
        type=Path,
        default=None,
        help="default: scenarios-<device>-<driver> in $TOKENMILL_REPORT_DIR or ~/.cache/tokenmill/reports",
    )
    common.add_engine_arguments(parser, exclude={f.name for f in fields(Sizes)})  # sizes set those
    _add_size_arguments(parser)


def _workload_name(text: str) -> str:
    name = text.replace("-", "_")
    if name not in (*WORKLOADS, ALL):
        raise argparse.ArgumentTypeError(
            f"unknown workload '{text}'; choose from {', '.join(WORKLOADS)}, all"
        )
    return name


def _add_size_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sizes (override the preset)")
    for size in fields(Sizes):
        default = getattr(PRESETS["cpu"], size.name)
        kind: Callable[[str], Any] = parse_length_range if isinstance(default, tuple) else type(default)
        metavar = "MIN-MAX" if isinstance(default, tuple) else None
        cpu, gpu = (_size_text(getattr(PRESETS[p], size.name)) for p in ("cpu", "gpu"))
        help_text = f"{size.metadata['help']} (cpu {cpu}, gpu {gpu})"
        group.add_argument(
            f"--{flag_name(size.name)}", type=kind, default=None, metavar=metavar, help=help_text
        )


def _size_text(value: Any) -> str:
    return f"{value[0]}-{value[1]}" if isinstance(value, tuple) else f"{value:g}"


def preset_name(args: argparse.Namespace, device: torch.device | None) -> str:
    if args.preset != "auto":
        return str(args.preset)
    return "gpu" if device is not None and device.type == "cuda" else "cpu"


def sizes_for(args: argparse.Namespace, device: torch.device | None) -> Sizes:
    overrides = {f.name: getattr(args, f.name) for f in fields(Sizes) if getattr(args, f.name) is not None}
    return replace(PRESETS[preset_name(args, device)], **overrides)


# -- one workload ---------------------------------------------------------------------------------------


def measure_workload(
    name: str,
    args: argparse.Namespace,
    loaded: LoadedModel,
    sizes: Sizes,
    source: TokenSource,
    measure: Measure,
) -> WorkloadResult:
    """The workload with its feature off, then on, each on a fresh engine over the same loaded model."""
    scenario = build_scenario(name, sizes, source, args.seed)
    max_model_len = common.fit_max_model_len_to(scenario.max_total_len, loaded, args.max_model_len)
    base = common.base_engine_config(args, loaded, max_model_len).with_options(**common.engine_options(args))
    toggle = TOGGLES[name]
    off, on = toggle.configs(base, sizes)
    show = not args.no_progress
    measured = [
        MeasuredConfig(toggle.off_label, off, measure(off, loaded, scenario, "off", show)),
        MeasuredConfig(toggle.on_label, on, measure(on, loaded, scenario, "on", show)),
    ]
    return WorkloadResult(scenario, toggle.name, config_difference(off, on), measured)


def _measure_for(args: argparse.Namespace) -> Measure:
    if args.driver == "offline":
        from tokenmill.benchmarks.scenarios.offline import measure_offline

        return measure_offline
    from tokenmill.benchmarks.scenarios import http_driver

    def measure_served(
        config: EngineConfig, loaded: LoadedModel, scenario: Scenario, label: str, show: bool
    ) -> ScenarioRun:
        return http_driver.measure_in_process(config, loaded, scenario, label, args.timeout, show)

    return measure_served


# -- the command ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    names = list(WORKLOADS) if args.workload == ALL else [args.workload]
    if args.url:
        from tokenmill.benchmarks.scenarios.servers import run_against_servers

        return run_against_servers(args, names, started)
    loaded = common.load_for_args(args)
    sizes = sizes_for(args, loaded.device)
    source = token_source(args.prompt_source, loaded.tokenizer, loaded.config.vocab_size)
    hardware = detect_hardware(loaded.device)
    driver = _driver_text(args.driver)
    header = header_lines(args, driver, describe_model(loaded), preset_name(args, loaded.device))
    print(f"hardware: {hardware.describe()}\n" + "\n".join(header), flush=True)
    measure = _measure_for(args)
    results = []
    for name in names:
        results.append(measure_workload(name, args, loaded, sizes, source, measure))
        print("\n" + section(results[-1]), flush=True)
    folder = report_dir(args.report_dir, f"scenarios-{device_kind(hardware)}-{args.driver}")
    meta = {"driver": args.driver, "sizes": sizes.__dict__}
    return finish(results, header, folder, started, meta, hardware.describe())


def _driver_text(driver: str) -> str:
    if driver == "offline":
        return "offline: an in-process LLMEngine stepped in a loop, requests added at their arrival times"
    return (
        "serve: tokenmill's OpenAI-compatible server started in this process for each config, driven over "
        "127.0.0.1 by bench serve's streaming client (/v1/completions, token-id prompts)"
    )


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


def main(argv: list[str] | None = None) -> int:
    from tokenmill.benchmarks import scenarios

    return common.run_as_script("scenarios", scenarios.__doc__, add_arguments, run, argv)
