"""Batch-1 decode in the engine, one knob at a time: kernel tiles and attention constants patched per
variant, every variant rebuilt (graphs recaptured) and timed in the same process, over several rounds.

Each variant's greedy tokens are compared with the first variant's (a tile change may flip a bf16
near-tie, which is worth knowing, not an error). ``--timeline`` also profiles one run of the first
variant and prints where a step's device time goes between kernels and copies.

    python scripts/gpu_batch1_sweep.py --variant base --variant gemv:gu:block_k=512 \\
        --variant attn:DECODE_MAX_UNSPLIT=0 --variant decode_config:64:8:1 [--timeline] [latency args]

Variants: ``base``; ``gemv:SHAPE:FIELD=V,...`` (SHAPE one of qkv, o, gu, down, lm; fields of
``GemvConfig``); ``attn:NAME=V,...`` (module constants of ``kernels/paged_attention.py``);
``decode_config:BLOCK_N:WARPS:STAGES`` (decode tiles while the batch has fewer (seq, KV head) pairs than
SMs). Latency arguments (``--input-len``, ``--max-model-len``...) follow ``tokenmill bench latency``;
the model defaults to llama-3.2-1b, dummy weights, bf16, Triton attention, graphs and overlap.
"""

import argparse
import collections
import contextlib
import gc
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

import tokenmill.kernels.gemv as gemv_module
import tokenmill.kernels.paged_attention as attention_module
from tokenmill.benchmarks import common, latency
from tokenmill.benchmarks.workload import WorkloadSpec
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel

DEFAULTS = ["--model", "llama-3.2-1b", "--load-format", "dummy", "--dtype", "bfloat16",
            "--attention-backend", "triton", "--cuda-graphs", "--overlap-decode"]  # fmt: skip


def projection_shapes(loaded: LoadedModel) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each one-row projection of a Llama-style decoder."""
    c = loaded.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gu": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm": (c.vocab_size, c.hidden_size),
    }


def variant_patch(spec: str, shapes: dict[str, tuple[int, int]]) -> contextlib.AbstractContextManager[object]:
    kind, _, rest = spec.partition(":")
    if kind == "base":
        return contextlib.nullcontext()
    if kind == "gemv":
        shape_name, _, fields = rest.partition(":")
        changes = {key: int(value) for key, value in (f.split("=") for f in fields.split(","))}
        default = gemv_module.default_gemv_config

        def config(out_features: int, in_features: int) -> gemv_module.GemvConfig:
            chosen = default(out_features, in_features)
            hit = (out_features, in_features) == shapes[shape_name]
            return chosen._replace(**changes) if hit else chosen

        return mock.patch.object(gemv_module, "default_gemv_config", config)
    if kind == "attn":
        stack = contextlib.ExitStack()
        for field in rest.split(","):
            name, value = field.split("=")
            stack.enter_context(mock.patch.object(attention_module, name, int(value)))
        return stack
    if kind == "decode_config":
        block_n, warps, stages = map(int, rest.split(":"))
        default_decode = attention_module.default_decode_config

        def decode_config(
            head_dim: int, dtype: torch.dtype, num_seq_heads: int = 0, num_sms: int = 0
        ) -> attention_module.DecodeConfig:
            if num_seq_heads < num_sms:
                return attention_module.DecodeConfig(block_n, warps, stages)
            return default_decode(head_dim, dtype, num_seq_heads, num_sms)

        return mock.patch.object(attention_module, "default_decode_config", decode_config)
    raise SystemExit(f"unknown variant {spec!r}")


def decode_tok_s(engine: LLMEngine, prompt: list[int], output_len: int, runs: int) -> tuple[float, list[int]]:
    latency.tokenmill_once(engine, prompt, output_len)
    samples = [latency.tokenmill_once(engine, prompt, output_len) for _ in range(runs)]
    return statistics.median(s.decode_tokens_per_s for s in samples), samples[-1].token_ids


def sweep(
    loaded: LoadedModel,
    prompt: list[int],
    config: EngineConfig,
    variants: list[str],
    args: argparse.Namespace,
) -> None:
    shapes = projection_shapes(loaded)
    results: dict[str, list[float]] = collections.defaultdict(list)
    reference: list[int] | None = None
    for round_index in range(args.rounds):
        for spec in variants:
            with variant_patch(spec, shapes):
                engine = LLMEngine(config, loaded=loaded)  # captures its graphs with the patch in place
                tok_s, tokens = decode_tok_s(engine, prompt, args.output_len, args.runs)
            reference = reference or tokens
            results[spec].append(tok_s)
            same = "same tokens" if tokens == reference else "tokens differ from the first variant"
            print(f"round {round_index} {spec:40s} {tok_s:8.1f} tok/s  {same}", flush=True)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    first = max(results[variants[0]])
    print(f"\n{'variant':40s} {'best tok/s':>10s} {'vs first':>8s}  rounds")
    for spec, values in results.items():
        print(f"{spec:40s} {max(values):10.1f} {max(values) / first:8.3f}  {[round(v) for v in values]}")


def timeline(loaded: LoadedModel, prompt: list[int], config: EngineConfig, output_len: int) -> None:
    """Device activities of one profiled run: the gaps between them summed by (before, after) pair."""
    from torch.profiler import ProfilerActivity, profile

    engine = LLMEngine(config, loaded=loaded)
    for _ in range(3):
        latency.tokenmill_once(engine, prompt, output_len)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run = latency.tokenmill_once(engine, prompt, output_len)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    device = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    gaps: dict[tuple[str, str], float] = collections.defaultdict(float)
    for before, after in itertools.pairwise(device):
        gaps[before["name"][:40], after["name"][:40]] += after["ts"] - before["ts"] - before["dur"]
    steps = output_len - 1
    print(f"profiled run: {run.decode_tokens_per_s:.1f} tok/s; gaps per decode step (us), largest first:")
    for (before, after), total in sorted(gaps.items(), key=lambda item: -item[1])[:20]:
        print(f"  {total / steps:8.2f}  {before} -> {after}")
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    latency.add_arguments(parser)
    group = parser.add_argument_group("sweep")
    group.add_argument(
        "--variant", action="append", default=[], help="repeatable; the first is the reference"
    )
    group.add_argument("--rounds", type=int, default=2)
    group.add_argument("--runs", type=int, default=9, help="timed runs per variant and round (median)")
    group.add_argument(
        "--cuda-graph-sizes-up-to", type=int, default=1, help="captured batch sizes (default 1)"
    )
    group.add_argument("--timeline", action="store_true")
    args = parser.parse_args(DEFAULTS + (sys.argv[1:] if argv is None else argv))  # later flags win
    loaded = common.load_for_args(args)
    spec = WorkloadSpec(1, (args.input_len, args.input_len), (args.output_len, args.output_len), args.seed)
    workload = common.workload_for(spec, loaded)
    prompt = workload.requests[0].prompt_token_ids
    max_model_len = common.fit_max_model_len(workload, loaded, args.max_model_len)
    config = latency.latency_engine_config(args, loaded, max_model_len)
    config = config.with_options(cuda_graph_max_batch_size=args.cuda_graph_sizes_up_to)
    print(f"batch 1, prompt {args.input_len}, {args.output_len} tokens, max_model_len {max_model_len}")
    if args.timeline:
        timeline(loaded, prompt, config, args.output_len)
    sweep(loaded, prompt, config, args.variant or ["base"], args)


if __name__ == "__main__":
    main()
