"""Triton attention against the PyTorch backend over a paged cache in shuffled blocks: decode (also
replayed from CUDA graphs), prefill, a mixed batch and packed sequences without a cache, with torch SDPA
on contiguous K/V as the peer; and the attention tile sweep (``--sweep``)."""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.attention import AttentionLayer, AttentionMetadata, KVCacheLayer, TorchAttentionBackend
from tokenmill.benchmarks.kernels.cases import Case
from tokenmill.benchmarks.kernels.shapes import ModelShape, Sizes, element_size, seeded_randn


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
        seeded_randn(pool_shape, dtype, device, 1), seeded_randn(pool_shape, dtype, device, 2)
    )
    metadata = _paged_metadata(seq_lens, query_lens, tables, shape.block_size)
    total = sum(query_lens)
    return AttentionInputs(
        _attention_layer(shape),
        seeded_randn((total, shape.heads, shape.head_dim), dtype, device, 3),
        seeded_randn((total, shape.kv_heads, shape.head_dim), dtype, device, 4),
        seeded_randn((total, shape.kv_heads, shape.head_dim), dtype, device, 5),
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

    size = element_size(dtype)
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
        q = seeded_randn((batch, shape.heads, query_len, shape.head_dim), dtype, device, 1)
        k = seeded_randn((batch, shape.kv_heads, context, shape.head_dim), dtype, device, 2)
        v = seeded_randn((batch, shape.kv_heads, context, shape.head_dim), dtype, device, 3)
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
