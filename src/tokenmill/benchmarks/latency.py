"""Batch-1 latency: prefill time for one prompt and decode time per token, tokenmill against HF generate.

Prefill is the time from submitting the prompt to its first output token; decode is the time per
token after that. Each is the median over ``--iters`` runs (after one warm-up run). Decoding one
sequence reads every weight and the whole KV context per token, so the report also gives the share of
the memory bandwidth measured by a large device copy in the same run.

    python -m tokenmill.benchmarks.latency [--input-len 128] [--output-len 64] [--iters 5]
"""

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.benchmarks import common
from tokenmill.benchmarks.arguments import add_latency_arguments as add_arguments
from tokenmill.benchmarks.common import run_as_script
from tokenmill.benchmarks.correctness import check_fast_path
from tokenmill.benchmarks.hf_peer import HFPeer, build_hf_peer
from tokenmill.benchmarks.measure import synchronize
from tokenmill.benchmarks.report import (
    describe_model,
    detect_hardware,
    fmt_bytes,
    header_lines,
    provenance_header,
)
from tokenmill.benchmarks.stats import median
from tokenmill.benchmarks.workload import WorkloadSpec, greedy_params
from tokenmill.cache.kv_pool import kv_bytes_per_token
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel
from tokenmill.models.layers import VocabParallelEmbedding
from tokenmill.quantization.gguf_method import packed_nbytes
from tokenmill.runner.kv_cache import cache_dtype

# Far above the last-level cache; larger on GPUs, where a smaller copy ends too fast to time well.
COPY_BYTES = {"cpu": 256 * 2**20, "cuda": 2 * 2**30}


@dataclass(frozen=True)
class Latency:
    prefill_s: float  # submit -> first token
    decode_s_per_token: float
    token_ids: list[int]

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.decode_s_per_token


def latency_from_times(token_times: list[float], token_ids: list[int]) -> Latency:
    if len(token_times) < 2:
        raise ValueError("decode time needs at least two output tokens")
    decode = (token_times[-1] - token_times[0]) / (len(token_times) - 1)
    return Latency(token_times[0], decode, token_ids)


def median_latency(run_once: Callable[[], Latency], iters: int) -> Latency:
    """One warm-up run, then the median prefill and median decode time over ``iters`` runs."""
    run_once()
    samples = [run_once() for _ in range(iters)]
    return Latency(
        median([s.prefill_s for s in samples]),
        median([s.decode_s_per_token for s in samples]),
        samples[-1].token_ids,
    )


def tokenmill_once(engine: LLMEngine, prompt: list[int], output_len: int) -> Latency:
    times: list[float] = []
    tokens: list[int] = []
    engine.reset_prefix_cache()  # every run prefills the whole prompt, as a new prompt would
    synchronize(engine.device)
    start = time.perf_counter()
    engine.add_request(f"latency-{start}", prompt, greedy_params(output_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            now = time.perf_counter() - start
            tokens.extend(delta.new_token_ids)
            times.extend([now] * len(delta.new_token_ids))
    return latency_from_times(times, tokens)


# -- memory bandwidth -------------------------------------------------------------------------------------


def copy_size(device: torch.device) -> int:
    return COPY_BYTES.get(device.type, COPY_BYTES["cpu"])


def measure_copy_bandwidth(device: torch.device, num_bytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s moved (read + written) by the fastest of ``repeats`` copies of a ``num_bytes`` buffer."""
    num_bytes = num_bytes or copy_size(device)
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy faults the target's pages in
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def weight_bytes_read_per_token(model: nn.Module) -> int:
    """Parameter bytes one decode step reads: every weight once, but of an input embedding table that
    is not also the output projection, only the one row looked up."""
    lm_head = getattr(model, "lm_head", None)
    lm_head_weight = getattr(lm_head, "weight", None)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(packed_nbytes(module) for module in model.modules())  # quantization "gguf"
    for module in model.modules():
        table = getattr(module, "weight", None)
        is_lookup = isinstance(module, nn.Embedding | VocabParallelEmbedding) and module is not lm_head
        if is_lookup and table is not None and table is not lm_head_weight:
            total -= (table.shape[0] - 1) * table.shape[1] * table.element_size()
    return total


def decode_bytes_per_token(
    loaded: LoadedModel, context_len: int, kv_cache_dtype: str = "auto"
) -> tuple[int, int]:
    """(weight bytes, KV bytes) read to decode one token at ``context_len`` tokens of context, with K/V
    stored as ``kv_cache_dtype`` says."""
    config = loaded.config
    kv_dtype = cache_dtype(kv_cache_dtype, loaded.dtype)
    kv_per_token = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype)
    return weight_bytes_read_per_token(loaded.model), kv_per_token * context_len


def bandwidth_share(bytes_per_token: int, seconds_per_token: float, bandwidth_bytes_per_s: float) -> float:
    """Fraction of the measured bandwidth a decode rate uses: 1.0 means memory-bound at that bandwidth."""
    return bytes_per_token / seconds_per_token / bandwidth_bytes_per_s


# -- compute -------------------------------------------------------------------------------------------


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int = 8192, repeats: int = 5
) -> float:
    """FLOP/s of the fastest of ``repeats`` square ``size`` GEMMs in ``dtype``: the matmul limit a long
    prefill approaches (its projections are GEMMs of this kind)."""
    size = size if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call picks the algorithm
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def prefill_flops(loaded: LoadedModel, num_tokens: int) -> float:
    """Matmul FLOPs of prefilling ``num_tokens``: every projection but the embedding lookup for each
    token, the LM head for the last one, and causal attention (QK and PV over half the square)."""
    model, config = loaded.model, loaded.config
    lm_head = getattr(model, "lm_head", None)
    projections = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding | VocabParallelEmbedding) or module is lm_head:
            continue
        projections += sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 2)
    head = config.vocab_size * config.hidden_size
    attention = 2 * config.num_layers * config.num_heads * config.head_dim * num_tokens**2
    return 2.0 * projections * num_tokens + 2.0 * head + attention


# -- the command ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    loaded = common.load_for_args(args)
    spec = WorkloadSpec(1, (args.input_len, args.input_len), (args.output_len, args.output_len), args.seed)
    workload = common.workload_for(spec, loaded)
    prompt = workload.requests[0].prompt_token_ids
    config = latency_engine_config(
        args, loaded, common.fit_max_model_len(workload, loaded, args.max_model_len)
    )
    check_prompts = common.workload_for(
        WorkloadSpec(4, (args.input_len, args.input_len), (1, 1), args.seed + 1), loaded
    ).prompts()
    check = check_fast_path(config, loaded, check_prompts, min(args.output_len, 32))
    if not check.passed:
        print(check.describe())
        print(
            "tokenmill latency: the fast path disagrees with the plain path; no number reported",
            file=sys.stderr,
        )
        return 1
    ours = tokenmill_latency(config, loaded, prompt, args.output_len, args.iters)
    peer = None if args.skip_hf else build_hf_peer(loaded)
    theirs = None
    if peer is not None:
        theirs = median_latency(lambda: hf_once(peer, prompt, args.output_len), args.iters)
    bandwidth = measure_copy_bandwidth(loaded.device)
    matmul = measure_matmul_flops(loaded.device, loaded.dtype)
    peer_text = "none (--skip-hf)" if peer is None else f"{peer.describe()}, batch 1"
    config_text = f"kv_cache={config.kv.mode}, batching={config.scheduler.batching}"
    workload_text = f"batch 1, {workload.describe()}, median of {args.iters} runs; tokenmill {config_text}"
    hardware = detect_hardware(loaded.device)
    header = header_lines("tokenmill latency", workload_text, describe_model(loaded), peer_text)
    _warn_if_different(ours, theirs)
    context = args.input_len + args.output_len // 2
    kv_dtype = config.kv.kv_cache_dtype
    results = result_lines(ours, theirs, loaded, context, bandwidth, args.input_len, kv_dtype)
    results.append(prefill_compute_line(ours, loaded, args.input_len, matmul))
    text = provenance_header(hardware) + "\n".join([*header, check.describe(), "", "```", *results, "```"])
    print(text)
    if args.report_dir is not None:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / "latency.md").write_text(text + "\n")
        print(f"wrote latency.md to {args.report_dir}")
    return 0


def latency_engine_config(args: argparse.Namespace, loaded: LoadedModel, max_model_len: int) -> EngineConfig:
    """The engine as asked; unless a KV size was given, a pool for one sequence (not the 2 GiB default)."""
    options = common.engine_options(args)
    config = common.base_engine_config(args, loaded, max_model_len).with_options(**options)
    if not {"num_kv_blocks", "cpu_kv_cache_gib", "gpu_memory_utilization"} & options.keys():
        config = config.with_options(num_kv_blocks=-(-max_model_len // config.kv.block_size))
    return config


def tokenmill_latency(
    config: EngineConfig, loaded: LoadedModel, prompt: list[int], output_len: int, iters: int
) -> Latency:
    engine = LLMEngine(config, loaded=loaded)
    return median_latency(lambda: tokenmill_once(engine, prompt, output_len), iters)


def hf_once(peer: HFPeer, prompt: list[int], output_len: int) -> Latency:
    tokens, times = peer.time_single(prompt, output_len)
    return latency_from_times(times, tokens)


def result_lines(
    ours: Latency,
    theirs: Latency | None,
    loaded: LoadedModel,
    context: int,
    bandwidth: float,
    input_len: int,
    kv_cache_dtype: str = "auto",
) -> list[str]:
    weights, kv = decode_bytes_per_token(loaded, context, kv_cache_dtype)
    kind = "device-to-device" if loaded.device.type == "cuda" else "memcpy"
    size = fmt_bytes(copy_size(loaded.device))
    lines = [
        f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s ({kind} copy of {size}, read + write)",
        f"bytes read per decode token: weights {fmt_bytes(weights)} + KV {fmt_bytes(kv)} at {context} tokens",
    ]
    rows = [("tokenmill", ours)] + ([("HF generate", theirs)] if theirs is not None else [])
    for name, result in rows:
        share = bandwidth_share(weights + kv, result.decode_s_per_token, bandwidth)
        prefill = f"prefill {result.prefill_s * 1e3:8.1f} ms ({input_len / result.prefill_s:8.1f} tok/s)"
        decode = (
            f"decode {result.decode_s_per_token * 1e3:7.2f} ms/token ({result.decode_tokens_per_s:7.1f} tok/s"
        )
        lines.append(f"{name:<12} {prefill}   {decode}, {share:.1%} of copy bandwidth)")
    if theirs is not None:
        prefill_ratio = theirs.prefill_s / ours.prefill_s
        decode_ratio = theirs.decode_s_per_token / ours.decode_s_per_token
        ratios = f"prefill {prefill_ratio:.2f}x, decode {decode_ratio:.2f}x"
        lines.append(f"speed ratio tokenmill / HF (above 1: tokenmill faster): {ratios}")
    return lines


def prefill_compute_line(ours: Latency, loaded: LoadedModel, input_len: int, matmul_flops: float) -> str:
    achieved = prefill_flops(loaded, input_len) / ours.prefill_s
    dtype = str(loaded.dtype).removeprefix("torch.")
    return (
        f"tokenmill prefill compute: {achieved / 1e12:.1f} TFLOP/s, {achieved / matmul_flops:.1%} of the "
        f"{dtype} matmul limit ({matmul_flops / 1e12:.1f} TFLOP/s, best square GEMM measured in this run)"
    )


def _warn_if_different(ours: Latency, theirs: Latency | None) -> None:
    if theirs is not None and theirs.token_ids and theirs.token_ids != ours.token_ids:
        print("warning: HF generate's greedy tokens differ from tokenmill's for this prompt", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    return run_as_script("latency", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
