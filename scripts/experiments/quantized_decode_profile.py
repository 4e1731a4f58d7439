"""Exploration for issue 18: where the GPU time of one batch-1 decode token goes, kernel by kernel, with
weights in bfloat16, int8 and fp8 (dummy weights, default engine settings: CUDA graphs, overlapped decode,
the auto kernels).

Each quantization runs in a fresh process (its GPU memory freed for the next). There: build the engine
through the offline API (``tokenmill.LLM``), then

* time batch-1 decode without the profiler: one 128-token random prompt decoding 160 tokens (greedy,
  ``ignore_eos``), one warm-up run then the median of ``--iters`` runs, as ``bench latency`` times it;
* run the same request again and record a stretch of ``--profile-steps`` decode steps in its middle with
  :func:`tokenmill.engine.profiling.profile_engine` (host and GPU, the engine's own profiler), and once
  more with the profiler recording the GPU alone (less host overhead, so the gaps it shows are closer to
  the unprofiled run's);
* time and trace back-to-back replays of the one-row decode graph (the GPU alone, no host in the loop);
* measure the copy bandwidth and the bytes a decode token reads (the latency bench's functions).

From each trace, cut to whole steps (between two occurrences of a kernel that runs once per step), per
decoded token: the window, the time some kernel runs (their union), the idle gaps by length and where the
longer ones sit (between which kernels), and every distinct kernel (by name and launch configuration, so
the projections' shapes stand apart): calls, mean µs a call, µs a token, and its added time. Kernels
started by programmatic launch wait inside for the kernel before, so their durations overlap and sum to
more than the window; a kernel's added time is the part of its span after every earlier kernel had ended,
and these sum to the union.

    PYTHONPATH=src python scripts/experiments/quantized_decode_profile.py [--model llama-3.1-8b] \
        [--quantizations none,int8,fp8] [--out DIR]
    PYTHONPATH=src python scripts/experiments/quantized_decode_profile.py --analyze TRACE[:STEPS] ...

The report goes to ``--out`` (default ``$OUT``, else ``reports/quantized_decode_profile``) as
``quantized_decode_profile.md``, with the GPU-only traces (and the host + GPU ones where small enough).
"""

import argparse
import collections
import gzip
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks import kernel_profile
from tokenmill.benchmarks.kernel_profile import Kernel
from tokenmill.benchmarks.latency import (
    bandwidth_share,
    decode_bytes_per_token,
    latency_from_times,
    measure_copy_bandwidth,
)
from tokenmill.benchmarks.measure import synchronize
from tokenmill.benchmarks.report import detect_hardware, markdown_table
from tokenmill.benchmarks.tensor_parallel.engines import in_fresh_process, random_prompts
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.profiling import profile_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported by path
from speculative_step_phases import replay_micros

# Kernel groups for the report, first match wins (names lower-cased). Wider than kernel_profile.KINDS:
# the W8A8 path's row quantization and epilogue count with the projections, the split argmax with sampling.
GROUPS = (
    ("attention", r"attention|attn|_decode_kernel|_prefill_kernel|merge_partitions|flash"),
    (
        "projections / GEMV",
        r"gemv|gemm|nvjet|cutlass|sm90_|sm80_|matmul|splitk|cublas|quantize_rows|int8_epilogue|scaled_mm",
    ),
    ("norm", r"norm"),
    ("rotary / KV write", r"rotary|write_kv|kv_write|rotate"),
    ("activation", r"activation|silu|gelu|swiglu"),
    ("sampling / argmax", r"argmax|gumbel|sampl|topk|softmax|bitmask|pick_best"),
    ("embedding", r"embedding|index_select|gather"),
    ("copies", r"memcpy|memset|copy|fill"),
)
TRACE_KEEP_BYTES = 12 * 2**20  # host + GPU traces copied to the output folder only below this size
TRACE_KEEP_TOTAL = 36 * 2**20
REPLAYS = 200
PROFILED_REPLAYS = 20


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, pattern in GROUPS:
        if re.search(pattern, lowered):
            return group
    return "other"


# -- the engine's runs ------------------------------------------------------------------------------------


def decode_run(
    engine: LLMEngine,
    prompt: list[int],
    output_len: int,
    on_token: Callable[[int], None] | None = None,
) -> tuple[list[float], list[int]]:
    """One greedy request, stepped by hand: each output token's time since submission, and the tokens.
    ``on_token(n)`` is called after each step with the tokens received so far."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.reset_prefix_cache()  # every run prefills the whole prompt
    synchronize(engine.device)
    times: list[float] = []
    tokens: list[int] = []
    start = time.perf_counter()
    engine.add_request(f"profile-{start}", prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            now = time.perf_counter() - start
            tokens.extend(delta.new_token_ids)
            times.extend([now] * len(delta.new_token_ids))
        if on_token is not None:
            on_token(len(tokens))
    return times, tokens


def timed_decode(engine: LLMEngine, prompt: list[int], output_len: int, iters: int) -> dict[str, Any]:
    """One warm-up run, then ``iters``: the median decode time a token ((last - first) / (n - 1), as the
    latency bench computes it) and the median of every run's median token-to-token interval."""
    decode_run(engine, prompt, output_len)
    means, medians, prefills = [], [], []
    tokens: list[int] = []
    for _ in range(iters):
        times, tokens = decode_run(engine, prompt, output_len)
        latency = latency_from_times(times, tokens)
        means.append(latency.decode_s_per_token)
        medians.append(statistics.median(b - a for a, b in itertools.pairwise(times)))
        prefills.append(latency.prefill_s)
    return {
        "decode_s": statistics.median(means),
        "decode_s_runs": means,
        "interval_median_s": statistics.median(medians),
        "prefill_s": statistics.median(prefills),
        "tokens": tokens,
    }


def profiled_stretch(
    engine: LLMEngine,
    prompt: list[int],
    output_len: int,
    skip: int,
    steps: int,
    directory: Path,
    gpu_only: bool,
) -> tuple[Path, int]:
    """The request again, recording from its ``skip``-th output token for ``steps`` engine steps: with the
    engine's profiler (host and GPU, every rank), or with the torch profiler on the GPU alone. Returns the
    trace and the number of engine steps run while recording."""
    state: dict[str, Any] = {"context": None, "recorded": 0, "profiler": None}
    directory.mkdir(parents=True, exist_ok=True)
    gpu_trace = directory / "trace-gpu-only.json"

    def on_token(received: int) -> None:
        if state["context"] is None and state["profiler"] is None and state["recorded"] == 0:
            if received >= skip:
                if gpu_only:
                    cuda = engine.device.type == "cuda"  # elsewhere the host's ops, so the code runs
                    activities = [
                        torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
                    ]
                    state["profiler"] = torch.profiler.profile(activities=activities)
                    state["profiler"].start()
                else:
                    state["context"] = profile_engine(engine, directory)
                    state["paths"] = state["context"].__enter__()
                state["recorded"] = 1
            return
        if state["recorded"] == 0 or state["recorded"] > steps:
            return
        state["recorded"] += 1
        if state["recorded"] > steps:
            stop()

    def stop() -> None:
        if state["context"] is not None:
            state["context"].__exit__(None, None, None)
            state["context"] = None
        if state["profiler"] is not None:
            synchronize(engine.device)
            state["profiler"].stop()
            state["profiler"].export_chrome_trace(str(gpu_trace))
            state["profiler"] = None

    decode_run(engine, prompt, output_len, on_token)
    if state["context"] is not None or state["profiler"] is not None:  # the request ended first
        stop()
    path = gpu_trace if gpu_only else state["paths"][0]
    return path, max(state["recorded"] - 1, 0)


def replay_graph(engine: LLMEngine, directory: Path) -> tuple[float | None, Path | None]:
    """µs a replay of the one-row decode graph, back to back on the GPU (CUDA events over ``REPLAYS``), and
    a GPU-only trace of ``PROFILED_REPLAYS`` of them. None without decode graphs."""
    graphs = engine.runner.decode_graphs
    if graphs is None or 1 not in graphs.graphs:
        return None, None
    graph = graphs.graphs[1]
    micros = replay_micros(graph, REPLAYS)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(PROFILED_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    path = directory / "trace-graph-replays.json"
    profiler.export_chrome_trace(str(path))
    return micros, path


# -- reading a trace --------------------------------------------------------------------------------------


def read_kernels(path: Path) -> list[Kernel]:
    """The trace's kernels and copies by start, each named with its launch configuration (grid, registers,
    shared memory), which tells apart the projections that run the same kernel on different shapes."""
    if not path.exists():
        return []
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as handle:
        events = json.load(handle)["traceEvents"]
    kernels = []
    for event in events:
        if event.get("ph") != "X" or event.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = event.get("args", {})
        name = event["name"]
        if "grid" in args:
            grid = "x".join(str(d) for d in args["grid"])
            registers, shared = args.get("registers per thread"), args.get("shared memory")
            name = f"{name} [grid {grid}, {registers} regs, {shared} B smem]"
        kernels.append(Kernel(name, float(event["ts"]), float(event.get("dur", 0.0))))
    return sorted(kernels, key=lambda kernel: kernel.start_us)


def critical_path(kernels: Sequence[Kernel]) -> dict[str, float]:
    """Per kernel name, the time it adds to the stream: the part of its span after every kernel before it
    has ended (kernels started by programmatic launch wait inside for the one before, so their durations
    overlap; these shares do not, and sum to the union of the spans)."""
    added: dict[str, float] = collections.defaultdict(float)
    frontier = None
    for kernel in kernels:
        finish = kernel.start_us + kernel.duration_us
        begin = kernel.start_us if frontier is None else max(frontier, kernel.start_us)
        added[kernel.name] += max(0.0, finish - begin)
        frontier = finish if frontier is None else max(frontier, finish)
    return added


def step_order(kernels: Sequence[Kernel], anchor: str) -> dict[str, int]:
    """Where each kernel name first runs in the step that starts after the first anchor (0: the anchor)."""
    order: dict[str, int] = {}
    started = False
    for kernel in kernels:
        started = started or kernel.name == anchor
        if started and kernel.name not in order:
            order[kernel.name] = len(order)
    return order


def whole_steps(kernels: Sequence[Kernel], expected_steps: int) -> tuple[list[Kernel], int, str]:
    """The kernels from one occurrence of an anchor kernel (one that runs once per step, the longest such)
    to its last occurrence, and the whole steps between: steady-state step periods, each with one of
    everything. Without an anchor, everything and ``expected_steps``."""
    counts: dict[str, int] = collections.Counter(k.name for k in kernels)
    totals: dict[str, float] = collections.defaultdict(float)
    for kernel in kernels:
        totals[kernel.name] += kernel.duration_us
    candidates = [name for name, count in counts.items() if abs(count - expected_steps) <= 3]
    if not candidates or expected_steps < 2:
        return list(kernels), max(expected_steps, 1), "none (all recorded kernels)"
    anchor = max(candidates, key=lambda name: totals[name])
    starts = [k.start_us for k in kernels if k.name == anchor]
    first, last = starts[0], starts[-1]
    inside = [k for k in kernels if first <= k.start_us < last]
    return inside, len(starts) - 1, anchor


def gap_sites(kernels: Sequence[Kernel], steps: int, min_gap_us: float = 2.0) -> list[list[str]]:
    """Idle gaps of at least ``min_gap_us``, summed by the kernels on either side (a gap after the end of
    every kernel before it), per token, longest first."""
    sites: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    end, previous = None, None
    for kernel in kernels:
        if end is not None and kernel.start_us - end >= min_gap_us:
            sites[(_short(previous or ""), _short(kernel.name))].append(kernel.start_us - end)
        finish = kernel.start_us + kernel.duration_us
        if end is None or finish >= end:
            previous = kernel.name
        end = finish if end is None else max(end, finish)
    rows = sorted(sites.items(), key=lambda item: -sum(item[1]))
    return [
        [
            before,
            after,
            f"{len(gaps) / steps:.2f}",
            f"{statistics.mean(gaps):.1f}",
            f"{sum(gaps) / steps:.1f}",
        ]
        for (before, after), gaps in rows[:12]
    ]


def small_gap_stats(kernels: Sequence[Kernel], steps: int) -> str:
    """How many gaps between consecutive kernels a token has, and their median length (every gap > 0)."""
    gaps, end = [], None
    for kernel in kernels:
        if end is not None and kernel.start_us > end:
            gaps.append(kernel.start_us - end)
        finish = kernel.start_us + kernel.duration_us
        end = finish if end is None else max(end, finish)
    if not gaps:
        return "no idle gaps"
    median, mean = statistics.median(gaps), statistics.mean(gaps)
    return f"{len(gaps) / steps:.1f} idle gaps a token, median {median:.2f} µs, mean {mean:.2f} µs"


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def trace_section(title: str, path: Path | None, expected_steps: int, step_s: float | None) -> list[str]:
    """Markdown: one trace's per-token summary, its per-kernel table and group totals."""
    kernels = read_kernels(path) if path is not None else []
    lines = [f"#### {title}", ""]
    if not kernels:
        return [*lines, "no GPU kernels in this trace", ""]
    inside, steps, anchor = whole_steps(kernels, expected_steps)
    summary = kernel_profile.summarize(inside, 0, top=10**6)
    idle = summary.window_us - summary.busy_us
    kernel_sum = sum(total for _, _, total in summary.top)
    lines += [
        f"- whole steps cut between occurrences of `{_short(anchor, 80)}`: {steps} tokens "
        f"({len(kernels)} kernels recorded over {expected_steps} engine steps)",
        f"- window (first kernel to last): {summary.window_us / steps:.1f} µs/token"
        + (f"; unprofiled decode {step_s * 1e6:.1f} µs/token" if step_s else ""),
        f"- some kernel running (union): {summary.busy_us / steps:.1f} µs/token "
        f"({summary.busy_us / summary.window_us:.1%} of the window); kernel durations summed: "
        f"{kernel_sum / steps:.1f} µs/token",
        f"- idle: {idle / steps:.1f} µs/token; by gap length: "
        + ", ".join(f"{bucket} {total / steps:.1f}" for bucket, total in summary.gaps.items()),
        f"- {small_gap_stats(inside, steps)}",
        "",
    ]
    added = critical_path(inside)
    order = step_order(inside, anchor)
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    rows = []
    for name, count, total in sorted(summary.top, key=lambda row: -added[row[0]]):
        group = group_of(name)
        groups[group][0] += count
        groups[group][1] += total
        groups[group][2] += added[name]
        rows.append(
            [
                name[:150],
                group,
                str(order.get(name, "-")),
                f"{count / steps:.2f}",
                f"{total / count:.2f}",
                f"{total / steps:.1f}",
                f"{added[name] / count:.2f}",
                f"{added[name] / steps:.1f}",
            ]
        )
    group_rows = [
        [
            group,
            f"{count / steps:.1f}",
            f"{total / steps:.1f}",
            f"{extra / steps:.1f}",
            f"{extra / summary.busy_us:.1%}",
        ]
        for group, (count, total, extra) in sorted(groups.items(), key=lambda item: -item[1][2])
    ]
    columns = ["kernel [launch]", "group", "#", "calls/token", "µs/call", "µs/token"]
    columns += ["added µs/call", "added µs/token"]
    lines += [
        "By group (µs: kernel durations summed; added: critical-path share, sums to the union):",
        "",
        markdown_table(["group", "calls/token", "µs/token", "added µs/token", "share of union"], group_rows),
        "",
        "Every kernel, by added time (#: order of first launch in a step, from the anchor; µs/call: mean "
        "duration, from start to end; added: the part of its span after every earlier kernel had ended):",
        "",
        markdown_table(columns, rows),
        "",
        "Idle gaps of 2 µs or more, by the kernels around them:",
        "",
        markdown_table(
            ["after (kernel that ended last)", "before", "gaps/token", "mean µs", "µs/token"],
            gap_sites(inside, steps),
        ),
        "",
    ]
    return lines


# -- one quantization, in its own process -----------------------------------------------------------------


def profile_one(options: dict[str, Any], send: Callable[[Any], None]) -> None:
    quantization = options["quantization"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = (
        options["dtype"] if options["dtype"] != "auto" else ("bfloat16" if device == "cuda" else "float32")
    )
    directory = Path(options["trace_dir"]) / quantization
    started = time.perf_counter()
    llm = LLM(model=options["model"], load_format="dummy", dtype=dtype, quantization=quantization)
    engine = llm.engine
    built_s = time.perf_counter() - started
    try:
        input_len, output_len = options["input_len"], options["output_len"]
        prompt = random_prompts(engine.model_config.vocab_size, 1, options["seed"], (input_len, input_len))[0]
        steps = options["profile_steps"]
        skip = max(1, (output_len - steps) // 2)
        timed = timed_decode(engine, prompt, output_len, options["iters"])
        full_trace, full_steps = profiled_stretch(engine, prompt, output_len, skip, steps, directory, False)
        gpu_trace, gpu_steps = profiled_stretch(engine, prompt, output_len, skip, steps, directory, True)
        replay_us, replay_trace = replay_graph(engine, directory) if device == "cuda" else (None, None)
        try:
            bandwidth = measure_copy_bandwidth(engine.device)
        except torch.OutOfMemoryError:  # the KV pool left too little for the latency bench's 2 GiB copy
            torch.cuda.empty_cache()
            bandwidth = measure_copy_bandwidth(engine.device, 512 * 2**20)
        context = input_len + output_len // 2
        weights, kv = decode_bytes_per_token(engine.loaded, context, engine.config.kv.kv_cache_dtype)
        decode_s = timed["decode_s"]
        share = bandwidth_share(weights + kv, decode_s, bandwidth)
        floor_us = (weights + kv) / bandwidth * 1e6
        lines = [
            f"### quantization {quantization}",
            "",
            f"- hardware: {detect_hardware(engine.device).describe()}",
            f"- engine: {engine.describe_startup()}",
            f"- engine built in {built_s:.1f} s; {len(timed['tokens'])} output tokens a run",
            f"- decode, unprofiled: {decode_s * 1e3:.3f} ms/token = **{1 / decode_s:.1f} tok/s** (median of "
            f"{options['iters']} runs of (last - first) / (n - 1); runs: "
            + ", ".join(f"{s * 1e3:.3f}" for s in timed["decode_s_runs"])
            + f" ms); median token-to-token interval {timed['interval_median_s'] * 1e6:.1f} µs; prefill "
            f"{timed['prefill_s'] * 1e3:.1f} ms",
            f"- bytes read per decode token: weights {weights / 1e9:.3f} GB + KV {kv / 1e6:.1f} MB at "
            f"{context} tokens of context",
            f"- copy bandwidth {bandwidth / 1e9:.0f} GB/s (device copy, read + write): the decode rate uses "
            f"{share:.1%} of it; those bytes at that bandwidth take {floor_us:.1f} µs",
        ]
        if replay_us is not None:
            lines.append(
                f"- one-row decode graph replayed back to back (GPU alone, {REPLAYS} replays): "
                f"{replay_us:.1f} µs a replay"
            )
        lines.append("")
        lines += trace_section(
            f"{quantization}: engine profiler (host + GPU), {full_steps} decode steps from token {skip}",
            full_trace,
            full_steps,
            decode_s,
        )
        lines += trace_section(
            f"{quantization}: GPU-only profiler, {gpu_steps} decode steps from token {skip}",
            gpu_trace,
            gpu_steps,
            decode_s,
        )
        if replay_trace is not None:
            lines += trace_section(
                f"{quantization}: {PROFILED_REPLAYS} back-to-back replays of the one-row decode graph "
                "(GPU-only profiler)",
                replay_trace,
                PROFILED_REPLAYS,
                None,
            )
        text = "\n".join(lines)
        print(text, flush=True)
        traces = [str(p) for p in (full_trace, gpu_trace, replay_trace) if p is not None and p.exists()]
        send({"quantization": quantization, "text": text, "tok_s": 1 / decode_s, "traces": traces})
    finally:
        llm.shutdown()


# -- the command ------------------------------------------------------------------------------------------


def keep_traces(results: list[dict[str, Any]], out: Path) -> list[str]:
    """Copy the GPU-only traces (gzipped) to ``out``, and the host + GPU ones while they stay small."""
    kept, total = [], 0
    for result in results:
        for trace in map(Path, result["traces"]):
            name = f"{result['quantization']}-{trace.name.removesuffix('.gz').removesuffix('.json')}.json.gz"
            target = out / name
            if trace.suffix == ".gz":
                size = trace.stat().st_size
                if size > TRACE_KEEP_BYTES or total + size > TRACE_KEEP_TOTAL or "replays" in name:
                    continue
                shutil.copyfile(trace, target)
            elif "replays" in name:
                continue
            else:
                with trace.open("rb") as source, gzip.open(target, "wb") as sink:
                    shutil.copyfileobj(source, sink)
                size = target.stat().st_size
            total += size
            kept.append(name)
    return kept


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="llama-3.1-8b", help="a preset name (dummy weights)")
    parser.add_argument("--quantizations", default="none,int8,fp8")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--profile-steps", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default $OUT, else reports/...")
    parser.add_argument("--trace-dir", type=Path, default=Path("/tmp/quantized_decode_profile"))
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds for each engine's process")
    parser.add_argument(
        "--analyze",
        nargs="+",
        metavar="TRACE[:STEPS]",
        help="only sum up traces written before (STEPS: the steps recorded, default --profile-steps)",
    )
    args = parser.parse_args()
    if args.analyze:
        for spec in args.analyze:
            path, _, steps = spec.partition(":")
            print("\n".join(trace_section(path, Path(path), int(steps or args.profile_steps), None)))
        return
    out = args.out or Path(os.environ.get("OUT") or "reports/quantized_decode_profile")
    out.mkdir(parents=True, exist_ok=True)
    header = [
        "# Batch-1 decode, kernel by kernel (issue 18)",
        "",
        f"- model {args.model} (dummy weights), {args.input_len}-token random prompt, "
        f"{args.output_len} output tokens (greedy, ignore_eos), {args.profile_steps} decode steps "
        "profiled from the middle",
        f"- command: {' '.join(sys.argv)}",
        "",
    ]
    results: list[dict[str, Any]] = []
    failed: list[str] = []
    for quantization in args.quantizations.split(","):
        options = dict(vars(args), quantization=quantization, trace_dir=str(args.trace_dir))
        options.pop("out")
        try:
            results.append(in_fresh_process(profile_one, options, timeout_s=args.timeout))
        except RuntimeError as error:
            print(f"quantization {quantization}: {error}", file=sys.stderr, flush=True)
            failed.append(quantization)
        write_report(out, header, results, failed, keep=False)  # what is done so far, should a later one hang
    summary = write_report(out, header, results, failed, keep=True)
    print("\n".join(summary))
    print(f"wrote {out / 'quantized_decode_profile.md'}", flush=True)


def write_report(
    out: Path, header: list[str], results: list[dict[str, Any]], failed: list[str], keep: bool
) -> list[str]:
    summary = ["| quantization | decode tok/s (unprofiled) |", "| --- | --- |"]
    summary += [f"| {r['quantization']} | {r['tok_s']:.1f} |" for r in results]
    summary += [f"| {q} | failed |" for q in failed]
    kept = keep_traces(results, out) if keep else []
    text = "\n".join([*header, *summary, "", *(r["text"] for r in results), "", f"traces kept: {kept}", ""])
    (out / "quantized_decode_profile.md").write_text(text)
    return summary


if __name__ == "__main__":
    main()
