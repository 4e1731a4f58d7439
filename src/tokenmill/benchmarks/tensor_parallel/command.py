"""Tensor parallelism on the GPUs of this machine against one GPU, every size measured in the same run.

- correctness: a preset's dummy weights written once as a float32 HF folder, loaded at every size;
  greedy tokens of a few prompts, batched, must equal size 1's (or no number is reported);
- all-reduce: the latency of one all-reduce at the sizes a step sends (a hidden row at batch 1, 8, 64,
  256), through NCCL and through symmetric memory, eagerly and inside a CUDA graph, and of the LM head's
  all-gather; the collectives' time per decoded token follows from those and the model's layer count;
- latency: batch-1 decode of the timed model (dummy weights) at each size (above 1: with the
  symmetric-memory all-reduce and with NCCL alone), with the bytes each rank reads per token over its
  time as a share of the copy bandwidth measured on one GPU;
- throughput: nano-vllm's offline workload at each size, every rank's KV pool sized by its own memory
  profile;
- profile (only when named): one batch-1 generation at each size under the torch profiler on every rank,
  its GPU time per token by kernel kind and idle gap, and the ranks' traces beside the report.

Each engine runs in a fresh process. Dummy weights are each rank's own random shard: the shapes and
timings of the real model, not its tokens (the correctness section loads real files).

    tokenmill bench tensor-parallel                  # llama-3.1-8b bf16 at sizes 1 and 2, every section
    tokenmill bench tensor-parallel --sections all-reduce,latency --sizes 1,2,4
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks.common import run_as_script
from tokenmill.benchmarks.kernel_profile import profile_tables
from tokenmill.benchmarks.latency import measure_copy_bandwidth
from tokenmill.benchmarks.report import detect_hardware, fmt_bytes, markdown_table, provenance_header
from tokenmill.benchmarks.tensor_parallel.all_reduce import CollectiveTiming, measure_collectives
from tokenmill.benchmarks.tensor_parallel.arguments import add_tensor_parallel_arguments as add_arguments
from tokenmill.benchmarks.tensor_parallel.engines import (
    DecodeRun,
    decode_latency,
    greedy_tokens,
    in_fresh_process,
    log_with_times,
    profiled_decode,
    random_prompts,
    throughput,
    write_check_folder,
)
from tokenmill.cache.kv_pool import kv_bytes_per_token
from tokenmill.config import EngineConfig
from tokenmill.loading.presets import load_preset

DECODE_ROWS = (1, 8, 64, 256)  # decode batches whose hidden rows the all-reduce section times


def engine_config(args: argparse.Namespace, size: int, max_model_len: int, **options: Any) -> EngineConfig:
    """The timed model (dummy weights) at tensor-parallel size ``size``."""
    return EngineConfig().with_options(
        model=args.model,
        load_format="dummy",
        device="cuda",
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=max_model_len,
        tensor_parallel_size=size,
        **options,
    )


def correctness(args: argparse.Namespace) -> tuple[list[str], bool]:
    """Greedy tokens at every size against size 1, on one float32 folder of dummy weights."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / args.check_model
        in_fresh_process(write_check_folder, args.check_model, folder, args.seed)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompts = random_prompts(vocab, args.check_prompts, args.seed)
        outputs = {}
        for size in args.sizes:
            config = EngineConfig().with_options(
                model=str(folder),
                device="cuda",
                dtype="float32",
                max_model_len=256,
                tensor_parallel_size=size,
            )
            outputs[size] = in_fresh_process(greedy_tokens, config, prompts, args.check_tokens, timeout_s=240)
    rows, passed = [], True
    for size, tokens in outputs.items():
        equal = sum(mine == theirs for mine, theirs in zip(tokens, outputs[1], strict=True))
        passed &= equal == len(prompts)
        rows.append([str(size), f"{equal} / {len(prompts)}", _first_divergence(tokens, outputs[1])])
    title = (
        f"## Greedy tokens against size 1 ({args.check_model}, dummy weights written once as a float32 "
        f"folder; {len(prompts)} prompts of 16-64 random tokens batched, {args.check_tokens} tokens each; "
        "CUDA graphs, overlapped decode and every default on)"
    )
    return [
        title,
        "",
        markdown_table(["size", "prompts equal to size 1", "first divergence"], rows),
        "",
    ], passed


def _first_divergence(tokens: list[list[int]], reference: list[list[int]]) -> str:
    for prompt, (mine, theirs) in enumerate(zip(tokens, reference, strict=True)):
        for position, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if a != b:
                return f"prompt {prompt}, token {position}: {a} vs {b}"
    return "none"


def collectives(args: argparse.Namespace, preset: dict[str, Any]) -> list[str]:
    """All-reduce and all-gather latency at the largest size, and what they cost a decoded token."""
    size = max(args.sizes)
    dtype = getattr(torch, args.dtype)
    row_bytes = preset["hidden_size"] * dtype.itemsize
    gather_bytes = preset["vocab_size"] // size * 4  # the LM head's float32 logits of one row
    timings = measure_collectives(size, [rows * row_bytes for rows in DECODE_ROWS], gather_bytes, dtype)
    table = [
        [
            timing.collective,
            fmt_bytes(timing.nbytes),
            timing.path,
            f"{timing.eager_us:.1f}",
            f"{timing.graph_us:.1f}",
            "-" if timing.max_error is None else f"{timing.max_error:.2g}",
        ]
        for timing in timings
    ]
    headers = ["collective", "per rank", "path", "eager µs", "in a CUDA graph µs", "max |error| vs NCCL"]
    return [
        f"## Collectives on {size} GPUs (median of 20 spans of 64 back-to-back calls, rank 0's events)",
        "",
        markdown_table(headers, table),
        "",
        *_per_token(timings, preset, row_bytes, gather_bytes),
        "",
    ]


def _per_token(
    timings: list[CollectiveTiming], preset: dict[str, Any], row_bytes: int, gather: int
) -> list[str]:
    """Batch-1 decode: two all-reduces per layer and the embedding's, one all-gather for the logits."""
    count = 2 * preset["num_hidden_layers"] + 1
    graph = {(t.collective, t.path, t.nbytes): t.graph_us for t in timings}
    gather_us = graph[("all-gather", "NCCL", gather)]
    lines = []
    for path in ("NCCL", "symmetric memory", "push"):
        one = graph.get(("all-reduce", path, row_bytes))
        if one is not None:
            total = count * one + gather_us
            lines.append(
                f"- per decoded token at batch 1, in graphs, all-reduces through {path}: {count} x "
                f"{one:.1f} µs + the all-gather {gather_us:.1f} µs = {total:.0f} µs"
            )
    return lines


def decode(args: argparse.Namespace, preset: dict[str, Any]) -> list[str]:
    """Batch-1 decode at every size (above 1, with and without the symmetric-memory all-reduce)."""
    max_model_len = args.input_len + args.output_len
    blocks = -(-max_model_len // EngineConfig().kv.block_size)  # one sequence's pool: no memory profile
    runs: list[tuple[int, str, DecodeRun]] = []
    for size in args.sizes:
        variants: list[tuple[str, dict[str, Any]]] = [("default", {})]
        if size > 1:
            variants.append(("NCCL only", {"custom_all_reduce": False}))
        variants += [(f"{name} off", {name: False}) for name in args.ablate]
        for name, options in variants:
            config = engine_config(args, size, max_model_len, num_kv_blocks=blocks, **options)
            run = in_fresh_process(
                decode_latency, config, args.input_len, args.output_len, args.iters, args.seed, timeout_s=240
            )
            runs.append((size, name, run))
            print(f"TP={size} {name}: {run.latency.decode_tokens_per_s:.1f} tok/s; {run.startup}", flush=True)
    bandwidth = measure_copy_bandwidth(torch.device("cuda", 0))
    context = args.input_len + args.output_len // 2
    base = runs[0][2].latency.decode_s_per_token
    rows = []
    for size, variant, run in runs:
        kv_heads = max(1, preset["num_key_value_heads"] // size)
        head_dim = preset.get("head_dim") or preset["hidden_size"] // preset["num_attention_heads"]
        kv = kv_bytes_per_token(preset["num_hidden_layers"], kv_heads, head_dim, getattr(torch, args.dtype))
        per_rank = run.weight_bytes_per_rank + kv * context
        seconds = run.latency.decode_s_per_token
        rows.append(
            [
                str(size),
                variant,
                run.all_reduce,
                f"{run.latency.prefill_s * 1e3:.1f}",
                f"{seconds * 1e3:.2f}",
                f"{1 / seconds:.1f}",
                f"{base / seconds:.2f}",
                fmt_bytes(per_rank),
                f"{per_rank / seconds / bandwidth:.1%}",
            ]
        )
    headers = [
        "size",
        "variant",
        "all-reduce",
        "prefill ms",
        "decode ms/token",
        "tok/s",
        "x size 1",
        "bytes/rank/token",
        "share of copy bw",
    ]
    return [
        f"## Batch-1 decode ({args.model}, dummy weights, {args.dtype}; {args.input_len}-token prompt, "
        f"{args.output_len} tokens, median of {args.iters} runs)",
        "",
        f"Copy bandwidth of one GPU, measured in this run: {bandwidth / 1e9:.0f} GB/s (read + write). Each "
        f"rank reads its shard of the weights and its KV heads at {context} tokens of context per token; the "
        "share is those bytes over the decode time and one GPU's copy bandwidth (every rank reads as much, "
        "so it is also the share of all the GPUs' bandwidth together).",
        "",
        markdown_table(headers, rows),
        "",
    ]


def offline_throughput(args: argparse.Namespace) -> list[str]:
    runs = [
        (
            size,
            in_fresh_process(throughput, engine_config(args, size, 2048), args.num_requests, timeout_s=200),
        )
        for size in args.sizes
    ]
    base = runs[0][1].output_tokens_per_s
    rows = [
        [
            str(size),
            f"{run.output_tokens_per_s:,.0f}",
            f"{run.output_tokens_per_s / base:.2f}",
            f"{run.elapsed_s:.1f}",
            str(run.num_steps),
            str(run.preemptions),
            fmt_bytes(run.kv_pool_bytes),
        ]
        for size, run in runs
    ]
    headers = ["size", "output tok/s", "x size 1", "seconds", "steps", "preemptions", "KV pool per rank"]
    return [
        f"## Offline throughput (nano-vllm's workload: {args.num_requests} requests, prompts and outputs of "
        f"100-1024 tokens, EOS ignored; {args.model}, dummy weights, {args.dtype}; every default)",
        "",
        markdown_table(headers, rows),
        "",
        *[f"- TP={size} start-up: {run.startup}" for size, run in runs],
        "",
    ]


def kernel_profile(args: argparse.Namespace) -> list[str]:
    """Batch-1 decode under the profiler at each size (its traces go to the report directory)."""
    max_model_len = args.input_len + args.profile_tokens
    blocks = -(-max_model_len // EngineConfig().kv.block_size)
    lines = [
        f"## Kernel profile of batch-1 decode ({args.model}, dummy weights, {args.dtype}; "
        f"{args.input_len}-token prompt, {args.profile_tokens} tokens, the prefill included)",
        "",
    ]
    for size in args.sizes:
        directory = (args.report_dir or Path(tempfile.mkdtemp())) / f"profile-tp{size}"
        config = engine_config(args, size, max_model_len, num_kv_blocks=blocks)
        found = in_fresh_process(
            profiled_decode, config, args.input_len, args.profile_tokens, directory, args.seed, timeout_s=300
        )
        seconds = found.latency.decode_s_per_token
        label = f"TP={size}: {1 / seconds:.1f} tok/s under the profiler ({seconds * 1e6:.0f} µs a token)"
        lines += profile_tables(found.summaries, args.profile_tokens, label)
        lines.append(f"Traces: {', '.join(found.traces)}")
        lines.append("")
    return lines


def run(args: argparse.Namespace) -> int:
    log_with_times()
    available = torch.cuda.device_count()
    if max(args.sizes) > available:
        print(
            f"tokenmill bench tensor-parallel: size {max(args.sizes)} needs as many GPUs; found {available}",
            file=sys.stderr,
        )
        return 2
    preset = load_preset(args.model)
    if preset is None:
        print(f"tokenmill bench tensor-parallel: no preset named {args.model!r}", file=sys.stderr)
        return 2
    hardware = detect_hardware(torch.device("cuda", 0))
    lines = [
        f"# Tensor parallelism: {available} x {hardware.name}, sizes {', '.join(map(str, args.sizes))}",
        "",
    ]
    for section in args.sections:  # in the order given; a failed correctness check reports nothing
        if section == "correctness":
            found, passed = correctness(args)
            if not passed:
                print("\n".join(found))
                print("CORRECTNESS CHECK FAILED: no numbers reported.", file=sys.stderr)
                return 1
        elif section == "all-reduce":
            found = collectives(args, preset) if max(args.sizes) > 1 else []
        elif section == "latency":
            found = decode(args, preset)
        elif section == "profile":
            found = kernel_profile(args)
        else:
            found = offline_throughput(args)
        lines += found
    text = provenance_header(hardware) + "\n".join(lines)
    print(text)
    if args.report_dir is not None:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / "tensor-parallel.md").write_text(text + "\n")
        print(f"wrote tensor-parallel.md to {args.report_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_as_script("tensor-parallel", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
