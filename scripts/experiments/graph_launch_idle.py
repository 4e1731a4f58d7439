"""Exploration for issue 17: what a CUDA graph costs when it is launched onto an idle GPU, as a batch-1
verification step's prefill graph is (the host computes its inputs from the step before while the GPU
waits), against the same graph replayed back to back or launched behind queued work.

Per graph of an engine with n-gram speculation (the one-row decode graph, the prefill graphs of 16 and
32 tokens), medians over ``--samples`` launches:

* ``back to back``: GPU µs per replay, 200 replays queued at once;
* ``replay() on the host``: the host's time inside ``graph.replay()`` (the GPU idle before it);
* ``from idle``: host clock from just before ``replay()`` until the GPU has finished it, and the CUDA
  events around it (GPU clock, from the event before the launch to the one after);
* ``behind a sleep``: the graph queued behind a ~300 µs GPU sleep, so its launch is hidden: the events'
  span from the end of the sleep to the end of the graph.

With ``--contexts``, instead: the prefill graphs' back-to-back replay with their inputs set to a chunk
of ``bucket - 7`` tokens after each context length (a verification step deep into a long output), with
``split_prefill_attention`` on and off.

    PYTHONPATH=src python scripts/experiments/graph_launch_idle.py [--model smollm2-135m] [--samples 50]
    (the script's folder must be importable: it takes replay_micros from speculative_step_phases.py)
    PYTHONPATH=src python scripts/experiments/graph_launch_idle.py --contexts 0,512,1024,2048,4000
"""

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from speculative_step_phases import replay_micros

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kernels.attention import plan, prefill
from tokenmill.loading import load_model


def spin(micros: float) -> None:
    """Keep the host busy (the GPU idles meanwhile)."""
    until = time.perf_counter() + micros * 1e-6
    while time.perf_counter() < until:
        pass


def from_idle(graph: torch.cuda.CUDAGraph, samples: int) -> dict[str, float]:
    host, wall, gpu = [], [], []
    for _ in range(samples):
        torch.cuda.synchronize()
        spin(300)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        started = time.perf_counter()
        graph.replay()
        launched = time.perf_counter()
        after.record()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append((launched - started) * 1e6)
        wall.append((done - started) * 1e6)
        gpu.append(before.elapsed_time(after) * 1e3)
    return {
        "replay() on the host": statistics.median(host),
        "from idle, host clock": statistics.median(wall),
        "from idle, GPU events": statistics.median(gpu),
    }


def behind_sleep(graph: torch.cuda.CUDAGraph, samples: int, cycles: int) -> float:
    spans = []
    for _ in range(samples):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        graph.replay()
        after.record()
        torch.cuda.synchronize()
        spans.append(before.elapsed_time(after) * 1e3)
    return statistics.median(spans)


def sleep_cycles_for(micros: float) -> int:
    """GPU sleep cycles lasting about ``micros`` µs on this GPU."""
    cycles = 1_000_000
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return int(cycles * micros / (begin.elapsed_time(end) * 1e3))


def report(label: str, graph: torch.cuda.CUDAGraph, samples: int, cycles: int) -> None:
    figures = {"back to back": replay_micros(graph), **from_idle(graph, samples)}
    figures["behind a sleep"] = behind_sleep(graph, samples, cycles)
    cells = ", ".join(f"{name} {value:.1f}" for name, value in figures.items())
    print(f"{label}: {cells} (µs)", flush=True)


def make_engine(model: str, k: int, max_model_len: int = 2048, **options: object) -> LLMEngine:
    loaded = load_model(model, device="cuda", dtype="bfloat16", load_format="dummy", seed=0)
    config = EngineConfig().with_options(
        model=model, device="cuda", max_model_len=max_model_len, num_kv_blocks=max_model_len // 16 + 64,
        speculative_method="ngram", num_speculative_tokens=k, **options,
    )  # fmt: skip
    return LLMEngine(config, loaded=loaded)


def context_replays(
    model: str, k: int, contexts: list[int], variants: list[tuple[int, int]], off: list[str]
) -> None:
    """Prefill graphs replayed over a chunk after each context, split_prefill_attention on and off."""
    longest = max(contexts) + 128
    for variant in [*variants, None]:
        split = variant is not None
        if variant is not None:  # (most partitions, rows x partitions a merge reads at once)
            plan.PREFILL_MAX_SPLITS, prefill.MERGE_ELEMENTS = variant[0], variant[1] * 64
        options = {**dict.fromkeys(off, False), "split_prefill_attention": split}
        runner = make_engine(model, k, longest, **options).runner
        graphs = runner.prefill_graphs
        assert graphs is not None
        cells = []
        for size in sorted(graphs.graphs)[:1]:
            for context in contexts:
                real = size - 7
                end = context + real
                blocks = -(-end // 16)
                arrays = {
                    "input_ids": np.zeros(real, np.int64),
                    "positions": np.arange(context, end, dtype=np.int64),
                    "slot_mapping": np.arange(context, end, dtype=np.int64),  # blocks 0.. in order
                    "seq_lens": np.array([end], np.int32),
                    "block_tables": np.arange(graphs.table_width, dtype=np.int32)[None, :]
                    * (np.arange(graphs.table_width)[None, :] < blocks),
                }
                graphs._write(arrays, size)
                cells.append(f"{size} tokens after {context}: {replay_micros(graphs.graphs[size]):.1f}")
        label = f"splits <= {variant[0]}, merge rows {variant[1]}" if variant else "unsplit"
        label += "".join(f", {name} off" for name in off)
        print(f"{model} {label}: " + ", ".join(cells) + " (µs)", flush=True)


def engine_graphs(model: str, k: int) -> list[tuple[str, Callable[[], torch.cuda.CUDAGraph]]]:
    engine = make_engine(model, k)
    runner = engine.runner
    out = []
    if runner.decode_graphs is not None:
        for size in sorted(runner.decode_graphs.graphs)[:2]:
            out.append((f"decode graph of {size}", runner.decode_graphs.graphs[size]))
    if runner.prefill_graphs is not None:
        for size in sorted(runner.prefill_graphs.graphs)[:3]:
            out.append((f"prefill graph of {size}", runner.prefill_graphs.graphs[size]))
    return out  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=24)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--contexts", help="comma-separated context lengths: replay over them instead")
    parser.add_argument("--off", action="append", default=[], help="an engine toggle to switch off")
    parser.add_argument("--variants", default="16:256", help="MAX_SPLITS:MERGE_ROWS (x head_dim 64),...")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if args.contexts:
        variants = [(int(a), int(b)) for a, b in (v.split(":") for v in args.variants.split(","))]
        context_replays(args.model, args.k, [int(c) for c in args.contexts.split(",")], variants, args.off)
        return
    cycles = sleep_cycles_for(300)
    for label, graph in engine_graphs(args.model, args.k):
        report(f"{args.model} {label}", graph, args.samples, cycles)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
