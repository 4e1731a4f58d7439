"""Kernel benchmark: each Triton kernel against the PyTorch code it replaces, at Llama-3.2-1B shapes.

Every kernel is first checked against its reference on the same inputs; a kernel whose output differs
is reported WRONG and not timed. Times are medians of ``triton.testing.do_bench`` (L2 flushed before
each run; while the flush runs on the GPU the host queues the timed launches, so for calls whose host
work is shorter than the flush this is GPU time). ``graph us`` replays the call from a CUDA graph, as the
engine's decode graphs do (decode attention captured with ``max_seq_len`` = the largest context, as
the engine captures with ``max_model_len``, 16 calls per graph on separate KV pools like a 16-layer
model's, time per call); ``host us`` is the host time per call of back-to-back eager
calls: the launch cost an eager step pays. GB/s counts the bytes a kernel must move at least (read once,
written once), shown against a device-to-device copy measured in the same run; prefill rows give
TFLOP/s instead. The attention peer is torch SDPA on contiguous, unpaged K/V: the speed of light for a
kernel that reads a paged cache.

Further sections: the sampler step (``tokenmill.benchmarks.sampler_bench``), the model layers on the
fused kernels against PyTorch (``tokenmill.benchmarks.fused_model_bench``) and, with ``--decode-sweep``,
decode attention under CUDA graphs over split counts and tiles (to tune ``plan_decode_split``).

    python -m tokenmill.benchmarks.kernels [--dtype bfloat16] [--quick] [--sweep] [--json PATH]

``--smoke`` runs tiny shapes with wall-clock timing; with ``TRITON_INTERPRET=1 ... --device cpu`` it
checks the script itself on a machine without a GPU.
"""

import argparse
import functools
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.attention import AttentionLayer, AttentionMetadata, KVCacheLayer, TorchAttentionBackend
from tokenmill.attention.torch_backend import write_kv_cache
from tokenmill.benchmarks.common import run_as_script
from tokenmill.benchmarks.report import markdown_table
from tokenmill.kernels import triton_available
from tokenmill.models.config import RopeConfig
from tokenmill.models.layers.activation import SiluAndMul
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding

Outputs = torch.Tensor | tuple[torch.Tensor, ...]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Largest relative (Frobenius) difference from the reference that still counts as correct.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """Llama-3.2-1B by default."""

    hidden: int = 2048
    intermediate: int = 8192
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    block_size: int = 16
    eps: float = 1e-5


@dataclass(frozen=True)
class Sizes:
    tokens: tuple[int, ...]  # rows for the elementwise kernels
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_len: int
    mixed: tuple[int, int, int]  # prefill chunk, decode sequences, their context


FULL = Sizes((1, 256, 4096), (1, 8, 64, 256), (128, 1024, 8192), 2048, (512, 64, 2048))
QUICK = Sizes((1, 4096), (1, 64), (128, 8192), 2048, (512, 64, 2048))
SMOKE = Sizes((1, 5), (1, 3), (40, 100), 48, (20, 3, 40))
HOST_TIMING_CALLS = 200
GRAPH_LAYERS = 16  # Llama-3.2-1B's layer count: one graph replays this many decode attention calls
GRAPH_INPUT_BYTES = 4 << 30


@dataclass
class Case:
    """One benchmark row: ``make_inputs`` builds fresh (seeded) inputs; the functions run on them."""

    kernel: str
    shape: str
    make_inputs: Callable[[], Any]
    triton_fn: Callable[[Any], Outputs]
    reference_fn: Callable[[Any], Outputs]
    bytes_moved: int = 0
    flops: int = 0
    peer: Callable[[], Callable[[], object]] | None = None  # builds a timed peer call
    time_reference: bool = True
    # Inputs for the CUDA-graph timing, when they differ from make_inputs' (decode: a max_seq_len bound).
    graph_inputs: Callable[[Any], Any] | None = None


@dataclass
class Row:
    kernel: str
    shape: str
    status: str = "ok"
    triton_s: float | None = None
    torch_s: float | None = None
    peer_s: float | None = None
    graph_s: float | None = None  # the Triton call replayed from a CUDA graph
    host_s: float | None = None  # host time per eager Triton call, back to back
    bytes_moved: int = 0
    flops: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# -- timing ---------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, device: torch.device, warmup_ms: int, rep_ms: int) -> None:
        self.device, self.warmup_ms, self.rep_ms = device, warmup_ms, rep_ms

    def __call__(self, fn: Callable[[], object]) -> float:
        """Median seconds per call."""
        if self.device.type == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, self.warmup_ms, self.rep_ms, return_mode="median")) / 1e3
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def graphed(self, fn: Callable[[], object]) -> float | None:
        """Median seconds per replay of ``fn`` captured in a CUDA graph (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
            fn()
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as error:  # the call does something a graph cannot hold (a host copy...)
            print(f"    (not capturable: {str(error).splitlines()[0][:100]})", flush=True)
            return None
        seconds = self(graph.replay)
        del graph
        return seconds

    def host(self, fn: Callable[[], object], calls: int = HOST_TIMING_CALLS) -> float:
        """Host seconds per call of ``calls`` back-to-back calls (the device catches up afterwards)."""
        fn()
        self.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        seconds = (time.perf_counter() - start) / calls
        self.synchronize()
        return seconds

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def copy_bandwidth(timer: Timer, device: torch.device, num_bytes: int) -> float:
    """Bytes/s read + written by a device-to-device copy of ``num_bytes``."""
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = timer(lambda: target.copy_(source))
    return 2 * num_bytes / seconds


# -- correctness ----------------------------------------------------------------------------------------


def relative_difference(ours: Outputs, reference: Outputs) -> float:
    pairs = zip(_as_tuple(ours), _as_tuple(reference), strict=True)
    worst = 0.0
    for a, b in pairs:
        if a.shape != b.shape:
            return math.inf
        diff = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)
        worst = max(worst, float(diff))
    return worst


def _as_tuple(outputs: Outputs) -> tuple[torch.Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def run_case(case: Case, timer: Timer, dtype: torch.dtype) -> Row:
    row = Row(case.kernel, case.shape, bytes_moved=case.bytes_moved, flops=case.flops)
    difference, times = _check_then_time(case, timer, dtype)
    row.extra["relative_difference"] = difference
    if times is None:
        row.status = f"WRONG ({difference:.1e})"
        return row
    row.triton_s, row.torch_s = times
    if case.graph_inputs is not None:
        row.graph_s = _graphed_per_layer(case, timer)
        inputs = case.graph_inputs(case.make_inputs())
        row.host_s = timer.host(lambda: case.triton_fn(inputs))
        del inputs
    if case.peer is not None:  # after the inputs above are freed
        row.peer_s = timer(case.peer())
    return row


def _graphed_per_layer(case: Case, timer: Timer) -> float | None:
    """Seconds per call in a graph of ``GRAPH_LAYERS`` calls on separate inputs (as a model's layers
    run, each on its own KV), which spreads the graph's launch over them; one call when that many
    copies of the inputs would not fit ``GRAPH_INPUT_BYTES``."""
    assert case.graph_inputs is not None
    layers = GRAPH_LAYERS if case.bytes_moved * GRAPH_LAYERS <= GRAPH_INPUT_BYTES else 1
    copies = [case.graph_inputs(case.make_inputs()) for _ in range(layers)]

    def all_layers() -> None:
        for inputs in copies:
            case.triton_fn(inputs)

    seconds = timer.graphed(all_layers)
    return seconds / layers if seconds is not None else None


def _check_then_time(
    case: Case, timer: Timer, dtype: torch.dtype
) -> tuple[float, tuple[float, float | None] | None]:
    """The relative difference from the reference, and (Triton, reference) seconds if it is small."""
    ours, theirs = case.make_inputs(), case.make_inputs()
    difference = relative_difference(case.triton_fn(ours), case.reference_fn(theirs))
    if not difference <= TOLERANCE[dtype]:
        return difference, None
    triton_s = timer(lambda: case.triton_fn(ours))
    reference_s = timer(lambda: case.reference_fn(theirs)) if case.time_reference else None
    return difference, (triton_s, reference_s)


# -- elementwise cases ----------------------------------------------------------------------------------


def elementwise_cases(
    shape: ModelShape, sizes: Sizes, dtype: torch.dtype, device: torch.device
) -> list[Case]:
    builders = (rms_norm_case, add_rms_norm_case, rotary_case, silu_and_mul_case, write_kv_case)
    return [build(shape, tokens, dtype, device) for tokens in sizes.tokens for build in builders]


def _norm_layer(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    norm = RMSNorm(shape.hidden, shape.eps).to(device=device, dtype=dtype)
    norm.weight.data.normal_(1.0, 0.1)
    return norm


def rms_norm_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.rmsnorm import rms_norm

    norm = _norm_layer(shape, dtype, device)
    return Case(
        "rms_norm",
        f"T={tokens} x {shape.hidden}",
        lambda: _seeded_randn((tokens, shape.hidden), dtype, device),
        lambda x: rms_norm(x, norm.weight, norm.eps),
        lambda x: norm(x),
        2 * tokens * shape.hidden * _element_size(dtype),
    )


def add_rms_norm_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.rmsnorm import add_rms_norm

    norm = _norm_layer(shape, dtype, device)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        rows = (tokens, shape.hidden)
        return _seeded_randn(rows, dtype, device, 1), _seeded_randn(rows, dtype, device, 2)

    return Case(
        "add_rms_norm",
        f"T={tokens} x {shape.hidden}",
        inputs,
        lambda xr: add_rms_norm(xr[0], xr[1], norm.weight, norm.eps),
        lambda xr: norm(xr[0], xr[1]),
        4 * tokens * shape.hidden * _element_size(dtype),
    )


def rotary_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.rotary import apply_rotary_

    rope = RotaryEmbedding(shape.head_dim, 8192, RopeConfig(theta=500000.0)).to(device)
    heads = shape.heads + shape.kv_heads

    def triton_fn(inputs: tuple[torch.Tensor, ...]) -> Outputs:
        positions, query, key = inputs
        apply_rotary_(positions, query, key, rope.cos_sin_cache)
        return query, key

    return Case(
        "rotary (q+k)",
        f"T={tokens} x {shape.heads}+{shape.kv_heads} heads x {shape.head_dim}",
        lambda: _rotary_inputs(shape, tokens, dtype, device),
        triton_fn,
        lambda inputs: rope(*inputs),
        2 * tokens * heads * shape.head_dim * _element_size(dtype) + tokens * shape.head_dim * 4,
    )


def silu_and_mul_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.activation import silu_and_mul

    return Case(
        "silu_and_mul",
        f"T={tokens} x 2*{shape.intermediate}",
        lambda: _seeded_randn((tokens, 2 * shape.intermediate), dtype, device),
        silu_and_mul,
        SiluAndMul(),
        3 * tokens * shape.intermediate * _element_size(dtype),
    )


def write_kv_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.kv_write import write_kv

    def triton_fn(inputs: tuple[torch.Tensor, ...]) -> Outputs:
        key, value, k_pool, v_pool, slots = inputs
        write_kv(key, value, k_pool, v_pool, slots)
        return k_pool, v_pool

    def reference_fn(inputs: tuple[torch.Tensor, ...]) -> Outputs:
        key, value, k_pool, v_pool, slots = inputs
        write_kv_cache(KVCacheLayer(k_pool, v_pool), key, value, slots)
        return k_pool, v_pool

    return Case(
        "write_kv",
        f"T={tokens} x {shape.kv_heads} x {shape.head_dim}",
        lambda: _kv_write_inputs(tokens, shape, dtype, device),
        triton_fn,
        reference_fn,
        4 * tokens * shape.kv_heads * shape.head_dim * _element_size(dtype),
    )


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def _seeded_randn(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)


def _rotary_inputs(
    shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, and query and key as strided views of one fused QKV output."""
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv = _seeded_randn((tokens, q_width + 2 * kv_width), dtype, device)
    query = qkv[:, :q_width].view(tokens, shape.heads, shape.head_dim)
    key = qkv[:, q_width : q_width + kv_width].view(tokens, shape.kv_heads, shape.head_dim)
    positions = torch.arange(tokens, device=device) % 8192
    return positions, query, key


def _kv_write_inputs(
    tokens: int, shape: ModelShape, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    num_blocks = tokens // shape.block_size + 16
    pool = torch.zeros(
        num_blocks, shape.block_size, shape.kv_heads, shape.head_dim, dtype=dtype, device=device
    )
    generator = torch.Generator(device=device).manual_seed(0)
    slots = torch.randperm(num_blocks * shape.block_size, generator=generator, device=device)[:tokens]
    kv = _seeded_randn((tokens, 2, shape.kv_heads, shape.head_dim), dtype, device)
    return kv[:, 0], kv[:, 1], pool, pool.clone(), slots


# -- attention cases ------------------------------------------------------------------------------------


@dataclass
class AttentionInputs:
    layer: AttentionLayer
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    metadata: AttentionMetadata
    cache: KVCacheLayer | None


def paged_batch(
    shape: ModelShape,
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionInputs:
    """Sequences whose context is already cached in shuffled blocks; the new tokens are to be written."""
    generator = torch.Generator(device=device).manual_seed(0)
    blocks = [-(-s // shape.block_size) for s in seq_lens]
    order = torch.randperm(sum(blocks), generator=generator, device=device).int()
    width = max(blocks)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[first : first + n]
        first += n
    pool_shape = (sum(blocks), shape.block_size, shape.kv_heads, shape.head_dim)
    cache = KVCacheLayer(
        _seeded_randn(pool_shape, dtype, device, 1), _seeded_randn(pool_shape, dtype, device, 2)
    )
    metadata = _paged_metadata(seq_lens, query_lens, tables, shape.block_size)
    total = sum(query_lens)
    return AttentionInputs(
        _attention_layer(shape),
        _seeded_randn((total, shape.heads, shape.head_dim), dtype, device, 3),
        _seeded_randn((total, shape.kv_heads, shape.head_dim), dtype, device, 4),
        _seeded_randn((total, shape.kv_heads, shape.head_dim), dtype, device, 5),
        metadata,
        cache,
    )


def batch_maker(
    shape: ModelShape,
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> Callable[[], AttentionInputs]:
    def make() -> AttentionInputs:
        return paged_batch(shape, seq_lens, query_lens, dtype, device)

    return make


def _paged_metadata(
    seq_lens: Sequence[int], query_lens: Sequence[int], tables: torch.Tensor, block_size: int
) -> AttentionMetadata:
    device = tables.device
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    query_lens_t = torch.tensor(query_lens, dtype=torch.int32, device=device)
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=device)
    starts[1:] = torch.cumsum(query_lens_t, 0)
    # Flat slots of the new tokens: positions seq_len - query_len .. seq_len - 1 of each sequence.
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), query_lens_t.long())
    positions = torch.arange(int(starts[-1]), device=device) - starts[seq_of_token].long()
    positions += (seq_lens_t - query_lens_t)[seq_of_token].long()
    blocks = tables[seq_of_token, positions // block_size].long()
    return AttentionMetadata(
        query_start_loc=starts,
        seq_lens=seq_lens_t,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        slot_mapping=blocks * block_size + positions % block_size,
        block_tables=tables,
    )


def _attention_layer(shape: ModelShape) -> AttentionLayer:
    return AttentionLayer(0, shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim**-0.5)


def _forward(backend: Any, inputs: AttentionInputs) -> torch.Tensor:
    out: torch.Tensor = backend.forward(
        inputs.layer, inputs.query, inputs.key, inputs.value, inputs.metadata, inputs.cache
    )
    return out


def attention_case(
    kernel: str,
    label: str,
    make_inputs: Callable[[], AttentionInputs],
    shape: ModelShape,
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    dtype: torch.dtype,
    peer: Callable[[], Callable[[], object]] | None = None,
    backend: Any = None,
) -> Case:
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    size = _element_size(dtype)
    kv_bytes = 2 * sum(seq_lens) * shape.kv_heads * shape.head_dim * size
    qo_bytes = 2 * sum(query_lens) * shape.heads * shape.head_dim * size
    # Causal: query i of a sequence with c cached tokens sees c + i + 1 keys; QK^T and PV, 2 flops a MAC.
    visible = sum(n * (s - n) + n * (n + 1) // 2 for s, n in zip(seq_lens, query_lens, strict=True))
    triton_backend = backend or TritonAttentionBackend()
    return Case(
        kernel,
        label,
        make_inputs,
        lambda inp: _forward(triton_backend, inp),
        lambda inp: _forward(TorchAttentionBackend(), inp),
        kv_bytes + qo_bytes,
        4 * visible * shape.heads * shape.head_dim,
        peer,
    )


def sdpa_peer(
    shape: ModelShape, batch: int, query_len: int, context: int, dtype: torch.dtype, device: torch.device
) -> Callable[[], Callable[[], object]]:
    """torch SDPA over contiguous ``[B, H, S, D]`` K/V (no paging), causal when the queries are the
    whole sequence."""

    def build() -> Callable[[], object]:
        q = _seeded_randn((batch, shape.heads, query_len, shape.head_dim), dtype, device, 1)
        k = _seeded_randn((batch, shape.kv_heads, context, shape.head_dim), dtype, device, 2)
        v = _seeded_randn((batch, shape.kv_heads, context, shape.head_dim), dtype, device, 3)
        causal = query_len > 1
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    return build


def decode_cases(shape: ModelShape, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    cases = []
    bound = max(sizes.decode_contexts)  # what a decode graph is captured with (max_model_len)
    for context in sizes.decode_contexts:
        for batch in sizes.decode_batches:
            seq_lens, query_lens = [context] * batch, [1] * batch
            case = attention_case(
                "decode attention",
                f"B={batch} ctx={context}",
                batch_maker(shape, seq_lens, query_lens, dtype, device),
                shape,
                seq_lens,
                query_lens,
                dtype,
                sdpa_peer(shape, batch, 1, context, dtype, device),
            )
            cases.append(replace(case, graph_inputs=functools.partial(with_max_seq_len, bound=bound)))
    return cases


def with_max_seq_len(inputs: AttentionInputs, bound: int) -> AttentionInputs:
    """The same step described with ``max_seq_len`` = ``bound``, as a captured decode graph sees it."""
    inputs.metadata = replace(inputs.metadata, max_seq_len=bound, derived={})
    return inputs


def prefill_cases(shape: ModelShape, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    n = sizes.prefill_len
    chunk, decodes, decode_context = sizes.mixed
    layouts: list[tuple[str, list[int], list[int], Callable[[], Callable[[], object]] | None]] = [
        (f"1 x {n} new", [n], [n], sdpa_peer(shape, 1, n, n, dtype, device)),
        (f"{n} new after {n} cached", [2 * n], [n], None),
        (f"8 x {n // 8} new", [n // 8] * 8, [n // 8] * 8, sdpa_peer(shape, 8, n // 8, n // 8, dtype, device)),
        (
            f"mixed: {chunk} new + {decodes} decodes @{decode_context}",
            [chunk] + [decode_context] * decodes,
            [chunk] + [1] * decodes,
            None,
        ),
    ]
    cases = [
        attention_case(
            "prefill attention",
            label,
            batch_maker(shape, seq_lens, query_lens, dtype, device),
            shape,
            seq_lens,
            query_lens,
            dtype,
            peer,
        )
        for label, seq_lens, query_lens, peer in layouts
    ]
    cases.append(
        attention_case(
            "varlen attention (no cache)",
            f"1 x {n}",
            lambda: _without_cache(paged_batch(shape, [n], [n], dtype, device)),
            shape,
            [n],
            [n],
            dtype,
        )
    )
    return cases


def _without_cache(inputs: AttentionInputs) -> AttentionInputs:
    inputs.metadata = AttentionMetadata.for_prefill([inputs.query.shape[0]], inputs.query.device)
    inputs.cache = None
    return inputs


# -- tile sweep -----------------------------------------------------------------------------------------


DECODE_SWEEP = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 3)]  # n, warps, stages
DECODE_PARTITIONS = (None, 512, 1024)  # None: the default heuristic
PREFILL_SWEEP = [
    (64, 64, 4, 2),
    (128, 64, 4, 2),
    (128, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 128, 8, 2),
    (64, 32, 4, 3),
]


def sweep_cases(shape: ModelShape, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """The attention kernels under several tile configurations (``--sweep``), to tune the defaults.
    Each is checked against the reference, but only the Triton kernel is timed."""
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.kernels.attention import DecodeConfig, PrefillConfig

    cases = []
    n = sizes.prefill_len
    for batch, context in [
        (1, max(sizes.decode_contexts)),
        (max(sizes.decode_batches), min(sizes.decode_contexts)),
    ]:
        seq_lens, query_lens = [context] * batch, [1] * batch
        for block_n, warps, stages in DECODE_SWEEP:
            for partition in DECODE_PARTITIONS:
                backend = TritonAttentionBackend(partition, DecodeConfig(block_n, warps, stages))
                name = f"decode n={block_n} w={warps} s={stages} part={partition or 'auto'}"
                cases.append(
                    _sweep_case(
                        name, f"B={batch} ctx={context}", shape, seq_lens, query_lens, dtype, device, backend
                    )
                )
    for config in PREFILL_SWEEP:
        backend = TritonAttentionBackend(prefill_config=PrefillConfig(*config))
        name = "prefill m={} n={} w={} s={}".format(*config)
        cases.append(_sweep_case(name, f"1 x {n} new", shape, [n], [n], dtype, device, backend))
    return cases


def _sweep_case(
    name: str,
    label: str,
    shape: ModelShape,
    seq_lens: list[int],
    query_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
    backend: Any,
) -> Case:
    maker = batch_maker(shape, seq_lens, query_lens, dtype, device)
    case = attention_case(name, label, maker, shape, seq_lens, query_lens, dtype, backend=backend)
    return replace(case, time_reference=False)


# -- report ---------------------------------------------------------------------------------------------


def format_rows(rows: Sequence[Row], copy_bytes_per_s: float) -> str:
    headers = [
        "kernel",
        "shape",
        "check",
        "triton us",
        "graph us",
        "host us",
        "torch us",
        "speedup",
        "sdpa us",
        "GB/s",
        "% copy",
        "TFLOP/s",
    ]
    lines = []
    for row in rows:
        fastest = min((t for t in (row.triton_s, row.graph_s) if t), default=None)
        gbps = row.bytes_moved / fastest / 1e9 if fastest and row.bytes_moved else None
        is_prefill = "prefill" in row.kernel or "varlen" in row.kernel
        lines.append(
            [
                row.kernel,
                row.shape,
                row.status,
                _us(row.triton_s),
                _us(row.graph_s),
                _us(row.host_s),
                _us(row.torch_s),
                f"{row.torch_s / row.triton_s:.2f}x" if row.triton_s and row.torch_s else "-",
                _us(row.peer_s),
                "-" if gbps is None or is_prefill else f"{gbps:.0f}",
                "-" if gbps is None or is_prefill else f"{100 * gbps * 1e9 / copy_bytes_per_s:.0f}%",
                f"{row.flops / row.triton_s / 1e12:.1f}"
                if row.triton_s and row.flops and is_prefill
                else "-",
            ]
        )
    return markdown_table(headers, lines)


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


# -- the command ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cuda", help="cuda, cuda:1 ... (cpu only with TRITON_INTERPRET=1)"
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script itself")
    parser.add_argument("--sweep", action="store_true", help="also time attention tile configurations")
    parser.add_argument("--only", default=None, help="run only kernels whose name contains this")
    parser.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up budget (default 25)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring budget (default 100)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel-by-kernel table")
    parser.add_argument("--no-sampler", action="store_true", help="skip the sampler step")
    parser.add_argument("--no-model", action="store_true", help="skip the fused-model check")
    parser.add_argument("--no-gemv", action="store_true", help="skip the small-batch projections")
    parser.add_argument(
        "--gemv-sweep", action="store_true", help="the GEMV over tile configurations (llama-3.2-1b, M=1)"
    )
    parser.add_argument(
        "--decode-sweep", action="store_true", help="decode attention under CUDA graphs over split counts"
    )
    parser.add_argument(
        "--profile-host", action="store_true", help="cProfile of eager decode calls (host time)"
    )


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if not triton_available(device):
        print(f"tokenmill bench kernels: triton cannot run on {device} here", file=sys.stderr)
        return 1
    dtype = DTYPES[args.dtype]
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    shape = ModelShape()
    timer = Timer(device, args.warmup_ms, args.rep_ms)
    print(_header(device, dtype, shape), flush=True)
    copy_bytes_per_s = copy_bandwidth(timer, device, COPY_BYTES if not args.smoke else 1 << 20)
    print(f"- device-to-device copy: {copy_bytes_per_s / 1e9:.0f} GB/s (read + write)", flush=True)
    cases = elementwise_cases(shape, sizes, dtype, device)
    cases += decode_cases(shape, sizes, dtype, device) + prefill_cases(shape, sizes, dtype, device)
    if args.only:
        cases = [c for c in cases if args.only in c.kernel]
    rows = _run_all(cases, timer, dtype, device) if not args.no_kernels else []
    if rows:
        print("\n" + format_rows(rows, copy_bytes_per_s), flush=True)
    wrong = _extra_sections(args, timer, device, dtype, sizes)
    if args.sweep:
        sweep = [
            c for c in sweep_cases(shape, sizes, dtype, device) if not args.only or args.only in c.kernel
        ]
        sweep_rows = _run_all(sweep, timer, dtype, device)
        print("\nTile sweep (defaults: tokenmill/kernels/attention/plan.py)\n", flush=True)
        print(format_rows(sweep_rows, copy_bytes_per_s), flush=True)
        rows += sweep_rows
    if args.json is not None:
        payload = {
            "copy_bytes_per_s": copy_bytes_per_s,
            "dtype": args.dtype,
            "rows": [asdict(r) for r in rows],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    wrong += [f"{r.kernel} [{r.shape}] {r.status}" for r in rows if r.status != "ok"]
    for line in wrong:
        print(f"error: {line}", file=sys.stderr)
    return 1 if wrong else 0


def _extra_sections(
    args: argparse.Namespace, timer: Timer, device: torch.device, dtype: torch.dtype, sizes: Sizes
) -> list[str]:
    """The host profiles, decode sweep, sampler and fused-model sections, each on its own (one that
    fails is reported and the next still runs); returns what failed its check."""
    sections: list[tuple[str, bool, Callable[[], list[str]]]] = [
        ("host profile", args.profile_host and device.type == "cuda", lambda: _host_profiles(device, dtype)),
        (
            "decode sweep",
            args.decode_sweep and device.type == "cuda",
            lambda: _decode_sweep(timer, device, dtype),
        ),
        ("gemv", not args.no_gemv, lambda: _gemv_section(timer, device, dtype, sizes, args.gemv_sweep)),
        ("sampler", not args.no_sampler, lambda: _sampler_section(timer, device, sizes)),
        ("fused model", not args.no_model and device.type == "cuda", lambda: _model_section(timer, device)),
    ]
    wrong: list[str] = []
    for name, wanted, section in sections:
        if not wanted:
            continue
        try:
            wrong += section()
        except Exception:  # report it; the other sections still run
            print(f"\n{name} section failed:\n{traceback.format_exc()}", flush=True)
            wrong.append(f"{name} section raised")
    return wrong


def _host_profiles(device: torch.device, dtype: torch.dtype) -> list[str]:
    from tokenmill.benchmarks import decode_sweep, sampler_bench

    print("\nHost profile of eager decode calls (B=1)\n\n" + decode_sweep.profile_decode_host(device, dtype))
    profile = sampler_bench.profile_sampler_host(device, sampler_bench.SamplingParams(temperature=0.8))
    print("\nHost profile of fused sampler steps (B=1, temperature)\n\n" + profile, flush=True)
    return []


def _decode_sweep(timer: Timer, device: torch.device, dtype: torch.dtype) -> list[str]:
    from tokenmill.benchmarks import decode_sweep

    rows, defaults = decode_sweep.decode_sweep(timer, device, dtype)
    print("\n" + decode_sweep.default_plans(device, dtype, decode_sweep.BATCHES, max(decode_sweep.CONTEXTS)))
    print(
        "\nDecode attention under CUDA graphs (us)\n\n" + decode_sweep.format_sweep(rows, defaults),
        flush=True,
    )
    return []


def _gemv_section(
    timer: Timer, device: torch.device, dtype: torch.dtype, sizes: Sizes, sweep: bool
) -> list[str]:
    from tokenmill.benchmarks import gemv_bench

    copy_bytes_per_s = copy_bandwidth(timer, device, COPY_BYTES if sizes is not SMOKE else 1 << 20)
    if sizes is SMOKE:
        models = [gemv_bench.Projection("tiny", name, 40, 96, prologue) for name, prologue in SMOKE_GEMV]
        rows = gemv_bench.gemv_rows(timer, device, dtype, (1,), models)
    else:
        rows = gemv_bench.gemv_rows(timer, device, dtype)
    table = gemv_bench.format_gemv_rows(rows, copy_bytes_per_s, dtype)
    print("\nSmall-batch projections (fused_gemv), per layer in CUDA graphs\n\n" + table, flush=True)
    if sweep:
        sweep_rows = gemv_bench.sweep_rows(timer, device, dtype)
        table = gemv_bench.format_gemv_rows(sweep_rows, copy_bytes_per_s, dtype)
        print("\nGEMV tile sweep (llama-3.2-1b, M=1)\n\n" + table, flush=True)
    return [f"gemv {r.projection.name} M={r.rows} {r.status}" for r in rows if r.status != "ok"]


SMOKE_GEMV = (("qkv_proj", "add_rms_norm"), ("o_proj", "none"), ("down_proj", "silu"))


def _sampler_section(timer: Timer, device: torch.device, sizes: Sizes) -> list[str]:
    from tokenmill.benchmarks import sampler_bench

    smoke = sizes is SMOKE
    vocab = 1000 if smoke else sampler_bench.VOCAB
    rows = sampler_bench.sampler_rows(timer, device, (1, 3) if smoke else sampler_bench.BATCHES, vocab)
    print(f"\nSampler step, vocab {vocab}\n\n" + sampler_bench.format_sampler_rows(rows), flush=True)
    return [f"sampler {r.params} B={r.batch} {r.status}" for r in rows if r.status != "ok"]


def _model_section(timer: Timer, device: torch.device) -> list[str]:
    from tokenmill.benchmarks import fused_model_bench

    rows = fused_model_bench.fused_model_rows(timer, device)
    print(
        "\nFused layer kernels in real model shapes\n\n" + fused_model_bench.format_model_rows(rows),
        flush=True,
    )
    return [f"fused model {r.preset} {r.dtype} {r.status}" for r in rows if r.status != "ok"]


def _run_all(cases: Sequence[Case], timer: Timer, dtype: torch.dtype, device: torch.device) -> list[Row]:
    rows = []
    for case in cases:
        started = time.perf_counter()
        try:
            row = run_case(case, timer, dtype)
        except torch.OutOfMemoryError:
            row = Row(case.kernel, case.shape, status="out of memory")
        rows.append(row)
        _release(device)
        took = time.perf_counter() - started
        print(f"  {case.kernel:28s} {case.shape:40s} {row.status:8s} ({took:.1f} s)", flush=True)
    return rows


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _header(device: torch.device, dtype: torch.dtype, shape: ModelShape) -> str:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    return "\n".join(
        [
            "# Triton kernels vs PyTorch",
            "",
            f"- device: {name}; torch {torch.__version__}, triton {triton.__version__}, {dtype}",
            f"- shapes: {shape}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    return run_as_script("kernels", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
