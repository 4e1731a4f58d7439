"""``tokenmill bench seeds``: the seed engines' published tables, regenerated on this machine.

The seeds publish four tables for GPT-2 124M in float32 on an A100 (their numbers are in
``seeds.published``); this command measures the same four with tokenmill, on the device at hand, and prints
each beside the seed's numbers (marked as from another machine):

1. ``kv-cache``: decode speed with the KV cache and with ``kv_cache="none"`` (recompute every step), one
   request at a time, by generation length and by prompt length; the ratio per row.
2. ``batch``: output tok/s by batch size with the peak memory (torch's CUDA allocator peak; on CPU the
   process's resident-set peak) and the KV pool's used bytes.
3. ``memory``: contiguous KV (a ``--context-len`` slab per sequence) vs paged KV (a fixed pool) by batch
   size: allocated and used bytes, the crossover, and where each runs out (caught and reported).
4. ``serving``: closed-loop users (1, 8, 32, 64, 128 on a GPU), sequential engine vs the default one.

The model is the ``gpt2`` preset with dummy weights unless ``--model`` names a folder (real weights); any
other preset works too (``--model llama-3.2-1b --dtype bfloat16``). Sizes: ``--preset gpu`` is the seed's,
``--quick`` (the ``cpu`` preset) fits 2 CPU cores in minutes; every size is a flag. Before any number, the
default engine's greedy tokens are checked against the plain path (``benchmarks.correctness``).

    tokenmill bench seeds --quick --report-dir reports/seeds-cpu
    tokenmill bench seeds --model llama-3.2-1b --dtype bfloat16 --report-dir reports/gpu/seeds-llama
"""

import argparse
import sys
import time
from pathlib import Path

from tokenmill.benchmarks.arguments import add_seeds_arguments as add_arguments
from tokenmill.benchmarks.common import run_as_script
from tokenmill.benchmarks.correctness import check_fast_path
from tokenmill.benchmarks.latency import measure_copy_bandwidth, weight_bytes_read_per_token
from tokenmill.benchmarks.report import (
    describe_model,
    detect_hardware,
    device_kind,
    header_lines,
    provenance,
    report_dir,
)
from tokenmill.benchmarks.seeds.batch_scaling import measure_batch_scaling
from tokenmill.benchmarks.seeds.engines import (
    SeedSetup,
    base_config,
    fixed_workload,
    memory_measured,
    release_memory,
)
from tokenmill.benchmarks.seeds.kv_memory import measure_kv_memory
from tokenmill.benchmarks.seeds.kv_speed import measure_kv_speed
from tokenmill.benchmarks.seeds.report import Roofline, SeedTables, plot, render
from tokenmill.benchmarks.seeds.serving import measure_serving
from tokenmill.benchmarks.seeds.sizes import sizes_from
from tokenmill.engine.llm_engine import resolve_device
from tokenmill.loading import load_model
from tokenmill.loading.presets import preset_names

DEFAULT_MODEL = "gpt2"
CHECK_PROMPTS, CHECK_PROMPT_LEN = 2, 16
RUN_ORDER = ("kv-cache", "batch", "serving", "memory")
PEER = (
    "the seed's published numbers (another machine, not this run); within each table, the other KV mode "
    "or the sequential engine, measured in the same run"
)


def model_and_format(model: str | None, load_format: str) -> tuple[str, str]:
    """The preset ``gpt2`` with dummy weights unless told otherwise; a preset name loads dummy weights."""
    name = model or DEFAULT_MODEL
    if load_format == "auto" and name in preset_names() and not Path(name).exists():
        return name, "dummy"
    return name, load_format


def setup_for(args: argparse.Namespace) -> SeedSetup:
    import torch

    device = resolve_device(args.device)
    preset = "cpu" if args.quick else args.preset
    if preset == "auto":
        preset = "gpu" if device.type == "cuda" else "cpu"
    sizes = sizes_from(args, preset)
    if sizes.kv_limit_gib == 0 and device.type != "cuda" and "memory" in args.tables:
        raise ValueError("--kv-limit-gib 0 (allocate until it fails) is for a GPU: give a limit on CPU")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, load_format = model_and_format(args.model, args.load_format)
    loaded = load_model(
        model, device=device, dtype=args.dtype, load_format=load_format, max_model_len=sizes.context_len,
        seed=args.seed, tokenizer=args.tokenizer,
    )  # fmt: skip
    if sizes.context_len > loaded.config.max_position_embeddings:
        raise ValueError(
            f"--context-len {sizes.context_len} exceeds the model's {loaded.config.max_position_embeddings}"
        )
    return SeedSetup(loaded, sizes, base_config(loaded, model, load_format, args.seed, sizes.context_len))


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    setup = setup_for(args)
    hardware = detect_hardware(setup.device)
    print(f"hardware: {hardware.describe()}\nmodel: {describe_model(setup.loaded)}", flush=True)
    prompts = fixed_workload(setup, CHECK_PROMPTS, CHECK_PROMPT_LEN, 1).prompts()
    check = check_fast_path(setup.config(), setup.loaded, prompts)
    print(check.describe(), flush=True)
    if not check.passed:
        print("CORRECTNESS CHECK FAILED: no numbers reported.", file=sys.stderr)
        return 1
    tables = measure_tables(setup, args.tables)
    origin = provenance(hardware)
    model_name = Path(setup.base.model or DEFAULT_MODEL).name
    title = f"tokenmill: the seed engines' tables ({model_name}, {device_kind(hardware)})"
    intro = [
        *header_lines(title, f"{', '.join(args.tables)}; {setup.sizes}", describe_model(setup.loaded), PEER),
        f"- correctness: {check.describe()}",
        f"- wall time: {time.perf_counter() - started:.0f} s for the whole command ("
        + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in tables.seconds.items())
        + ")",
    ]  # fmt: skip
    lengths = (setup.sizes.batch_input_len, setup.sizes.batch_output_len)
    text = render(tables, intro, memory_measured(setup.device), lengths)
    print(text, flush=True)
    directory = report_dir(args.report_dir, f"seeds-{model_name}-{device_kind(hardware)}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "seeds.md").write_text(origin.markdown() + text + "\n")
    plotted = plot(tables, directory / "seeds.png", title, origin)
    print(
        f"report: {directory / 'seeds.md'}" + (" and seeds.png" if plotted else " (no matplotlib: no plot)")
    )
    return 0


def measure_tables(setup: SeedSetup, names: tuple[str, ...]) -> SeedTables:
    """Each table asked for; one that fails is reported as failed and the others still run. The memory
    table runs last: on a GPU it allocates until the allocation fails."""
    tables = SeedTables(roofline=roofline(setup))
    for name in sorted(names, key=RUN_ORDER.index):
        started = time.perf_counter()
        try:
            _measure(setup, name, tables)
            tables.seconds[name] = time.perf_counter() - started
        except Exception as error:
            release_memory(setup.device)
            tables.failures[name] = f"{type(error).__name__}: {error}"
            print(f"table {name} FAILED: {tables.failures[name]}", file=sys.stderr, flush=True)
    return tables


def roofline(setup: SeedSetup) -> Roofline:
    bandwidth = measure_copy_bandwidth(setup.device)
    return Roofline(bandwidth, weight_bytes_read_per_token(setup.loaded.model), setup.kv_bytes_per_token())


def _measure(setup: SeedSetup, name: str, tables: SeedTables) -> None:
    if name == "kv-cache":
        tables.speed = measure_kv_speed(setup)
    elif name == "batch":
        tables.batch = measure_batch_scaling(setup)
    elif name == "memory":
        tables.memory = measure_kv_memory(setup)
    elif name == "serving":
        tables.serving = measure_serving(setup)


def main(argv: list[str] | None = None) -> int:
    return run_as_script("seeds", __doc__, add_arguments, run, argv)
