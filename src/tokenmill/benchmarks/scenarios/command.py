"""Scheduling-feature scenarios: five workloads, each run with its feature off and on in the same run.

    tokenmill bench scenarios [--workload all|continuous_batching|burst|chunked_prefill|prefix_caching|
                              multi_turn] [--driver offline|serve] [--url URL [--url URL]]
                              [--preset auto|cpu|gpu] [--<size> N ...] [--model M --load-format dummy
                              --device cuda ...] [--report-dir DIR]

| workload              | arrivals                                          | feature toggled               |
|-----------------------|---------------------------------------------------|-------------------------------|
| `continuous_batching` | mixed prompt/output lengths, Poisson              | `batching` static, continuous |
| `burst`               | the same kind of requests, all at t=0             | `batching` static, continuous |
| `chunked_prefill`     | short-prompt streams, long prompts (75%) join     | `chunked_prefill` + budget    |
| `prefix_caching`      | one shared prefix, distinct suffixes, Poisson     | `prefix_caching`              |
| `multi_turn`          | conversations re-sending their history every turn | `prefix_caching`              |

Why a command of its own rather than a ``--workload`` on ``bench serve``: ``bench serve`` measures one
server someone else started, at several concurrency levels; a scenario is a workload *and* the engine
config pair it compares, so it has to own the engine (or be handed two servers). Its flags follow
``bench serve`` / vLLM's ``vllm bench serve`` where they mean the same (``--url``, ``--api-key``,
``--seed``, ``--report-dir``; request rates are Poisson arrivals per second).

Two drivers replay the same workload definitions:

- ``offline`` (default): an in-process ``LLMEngine`` stepped in a loop; a request is added when its
  arrival time has come, and every new token is stamped with the time its step returned. No HTTP, so
  this driver imports neither FastAPI, uvicorn nor httpx.
- ``serve``: tokenmill's OpenAI-compatible server started in this process for each config (over the
  model loaded once) and driven over 127.0.0.1 by ``bench serve``'s streaming client; or, with
  ``--url``, servers already running (two URLs: feature off, then on). It needs a model with a tokenizer
  (the server streams text), so not dummy weights.

Per config: TTFT and ITL percentiles (p50/p90/p99), output tok/s and requests/s, and on/off ratios; the
target of a workload, where it has one, is checked on the measured numbers (chunked_prefill: ITL p99
within 3x its p50 with the feature on; prefix_caching: TTFT p50 cut at least 2x and throughput raised).
Greedy outputs must be identical off and on (token ids offline, text over HTTP); a workload where they
are not gets no numbers, its differences are printed, and the command exits non-zero. Written to the
report folder: scenarios.md (starting with its provenance: commit, command, machine, date),
scenarios.json and a PNG per workload. The folder is ``--report-dir``, else
``scenarios-<device>-<driver>`` (``scenarios-url`` with ``--url``) in ``$TOKENMILL_REPORT_DIR`` or
``~/.cache/tokenmill/reports``: never the source tree unless named.

Sizes come from a preset (``cpu``: all five in about ten minutes on two cores with the default model;
``gpu``: 48 requests on a 1024-token prefix, 4096-token prompts among streams, ...), each overridable by
its own flag (``--prefix-len 1024``, ``--batching-rate 4``; see ``--help``). Examples:

    tokenmill bench scenarios --workload prefix_caching --threads 1
    tokenmill bench scenarios --model qwen3-0.6b --load-format dummy --device cuda --dtype float32
    tokenmill bench scenarios --workload chunked_prefill --driver serve
    tokenmill bench scenarios --workload prefix_caching --url http://127.0.0.1:8000 --url http://127.0.0.1:8001
"""

import argparse
import time
from collections.abc import Callable

from tokenmill.benchmarks import common
from tokenmill.benchmarks.arguments import ALL_WORKLOADS as ALL
from tokenmill.benchmarks.arguments import add_scenarios_arguments as add_arguments
from tokenmill.benchmarks.report import describe_model, detect_hardware, device_kind, report_dir
from tokenmill.benchmarks.scenarios.features import TOGGLES, config_difference
from tokenmill.benchmarks.scenarios.report import MeasuredConfig, WorkloadResult, section
from tokenmill.benchmarks.scenarios.results import finish, header_lines
from tokenmill.benchmarks.scenarios.sizes import Sizes, preset_name, sizes_for
from tokenmill.benchmarks.scenarios.traces import ScenarioRun
from tokenmill.benchmarks.scenarios.workloads import (
    WORKLOADS,
    Scenario,
    TokenSource,
    build_scenario,
    token_source,
)
from tokenmill.config import EngineConfig
from tokenmill.loading import LoadedModel

# (config, loaded, scenario, label, show progress) -> the run
Measure = Callable[[EngineConfig, LoadedModel, Scenario, str, bool], ScenarioRun]


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


def main(argv: list[str] | None = None) -> int:
    return common.run_as_script("scenarios", __doc__, add_arguments, run, argv)
