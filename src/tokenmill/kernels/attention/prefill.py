"""Prefill and mixed batches: packed queries of any lengths, each program a tile of consecutive query
tokens of one sequence (times the group's heads as rows); key tiles that every row sees skip the mask.
``varlen_attention`` runs the same kernel over packed whole sequences with no cache.

A launch of few query tokens over a long context (a speculative verification step: 1 + k tokens of one
sequence) has only a few query tiles, so a few programs would walk the whole context. With ``split``
each tile's visible keys are cut into partitions as decode attention cuts a context (one program per
partition, ``plan_prefill_split``), and the last program of a tile to finish merges the partials."""

from typing import Any

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2, require_unit_last_stride
from tokenmill.kernels.attention.checks import check_pools
from tokenmill.kernels.attention.partitions import decode_partials, partition_length, store_partition
from tokenmill.kernels.attention.plan import (
    MIN_DOT_ROWS,
    DecodeSplit,
    PrefillConfig,
    default_prefill_config,
    plan_prefill_split,
)
from tokenmill.kernels.attention.query_tiles import cached_tiles
from tokenmill.kernels.attention.tiles import LOG2E, attend_range, dot_precision
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel

# A split tile's merge reads merge_chunk partitions of its block_m rows per round: block_m x chunk x
# head_dim floats, at most this many (two partitions of 128 rows of head_dim 64 a round was faster than one
# on the H200: the 16-token SmolLM2 prefill graph after 4,000 keys 1,087 µs against 1,317).
MERGE_ELEMENTS = 16384


# Per-step values are not specialized on (Triton would compile a variant for 1 / multiples of 16 of each).
@triton.jit(
    do_not_specialize=[
        "window",
        "num_seqs",
        "block_table_stride",
        "num_splits",
        "min_partition",
        "max_unsplit",
    ]
)
def _prefill_kernel(
    query_ptr: tl.tensor,
    key_ptr: tl.tensor,
    value_ptr: tl.tensor,
    out_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    query_start_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    tile_seq_ptr: tl.tensor,
    tile_index_ptr: tl.tensor,
    part_out_ptr: tl.tensor,
    part_max_ptr: tl.tensor,
    part_sum_ptr: tl.tensor,
    arrivals_ptr: tl.tensor,
    scale_log2: float,
    window: int,
    num_seqs: int,
    num_query_heads: int,
    num_splits: int,
    min_partition: int,
    max_unsplit: int,
    query_token_stride: int,
    query_head_stride: int,
    out_token_stride: int,
    out_head_stride: int,
    block_table_stride: int,
    kv_block_stride: int,
    kv_slot_stride: int,
    kv_head_stride: int,
    group: tl.constexpr,
    tokens_per_tile: tl.constexpr,
    block_m: tl.constexpr,
    block_n: tl.constexpr,
    head_dim: tl.constexpr,
    block_size: tl.constexpr,
    paged: tl.constexpr,
    has_window: tl.constexpr,
    split: tl.constexpr,  # the visible keys are cut into num_splits partitions (never with a window)
    merge_chunk: tl.constexpr,
    precision: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    wait_for_previous_kernel(pdl)  # every input (the tile map too) may come from a kernel before this one
    seq = tl.load(tile_seq_ptr + program).to(tl.int64)
    if seq >= num_seqs:  # the grid is sized for the most tiles any batch of this shape can have
        return
    tile = tl.load(tile_index_ptr + program)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Row r is query token tile * tokens_per_tile + r // group of the sequence, query head
    # kv_head * group + r % group; rows past the sequence's last token are padding.
    rows = tl.arange(0, block_m)
    tokens = tile * tokens_per_tile + rows // group
    heads = kv_head * group + rows % group
    row_ok = (rows < tokens_per_tile * group) & (tokens < query_len)
    first_pos = context_len + tile * tokens_per_tile
    last_pos = tl.minimum(first_pos + tokens_per_tile, seq_len) - 1
    query_pos = tl.minimum(context_len + tokens, last_pos)  # padding rows copy the last query's position
    dims = tl.arange(0, head_dim)
    q_rows = (query_start + tokens).to(tl.int64)
    q_ptrs = query_ptr + q_rows[:, None] * query_token_stride + heads[:, None] * query_head_stride
    q = tl.load(q_ptrs + dims[None, :], mask=row_ok[:, None], other=0.0)

    # Keys [lo, hi) are visible to some row; [full_lo, first_pos] to every row. The unmasked middle
    # range is rounded down to whole tiles; the masked ranges around it take the rest.
    lo = tl.maximum(first_pos - window + 1, 0) if has_window else 0
    full_lo = tl.maximum(last_pos - window + 1, 0) if has_window else 0
    hi = last_pos + 1
    full_hi = full_lo + tl.maximum(first_pos + 1 - full_lo, 0) // block_n * block_n
    # This program's partition [part_lo, part_hi) of [lo, hi): all of it unless split. Split partitions
    # are whole key tiles from lo = 0 (no window), so their share of [full_lo, full_hi) stays whole tiles.
    partition_len = partition_length(hi - lo, num_splits, min_partition, max_unsplit, block_n)
    part_lo = lo + tl.program_id(2) * partition_len
    if part_lo >= hi:  # past this tile's keys: the merge does not read this partition
        return
    part_hi = tl.minimum(part_lo + partition_len, hi)

    row_max = tl.full([block_m], float("-inf"), tl.float32)
    row_sum = tl.zeros([block_m], tl.float32)
    acc = tl.zeros([block_m, head_dim], tl.float32)
    key_base = key_ptr + kv_head * kv_head_stride
    value_base = value_ptr + kv_head * kv_head_stride
    table_ptr = block_tables_ptr + seq * block_table_stride
    kv_base_row = query_start - context_len  # unpaged K/V: packed row of position 0
    row_max, row_sum, acc = attend_range(
        q,
        row_max,
        row_sum,
        acc,
        query_pos,
        key_base,
        value_base,
        table_ptr,
        kv_base_row,
        tl.maximum(lo, part_lo),
        tl.minimum(full_lo, part_hi),
        scale_log2,
        window,
        kv_block_stride,
        kv_slot_stride,
        block_n,
        head_dim,
        block_size,
        paged,
        has_window,
        True,
        precision,
    )
    row_max, row_sum, acc = attend_range(
        q,
        row_max,
        row_sum,
        acc,
        query_pos,
        key_base,
        value_base,
        table_ptr,
        kv_base_row,
        tl.maximum(full_lo, part_lo),
        tl.minimum(full_hi, part_hi),
        scale_log2,
        window,
        kv_block_stride,
        kv_slot_stride,
        block_n,
        head_dim,
        block_size,
        paged,
        has_window,
        False,
        precision,
    )
    row_max, row_sum, acc = attend_range(
        q,
        row_max,
        row_sum,
        acc,
        query_pos,
        key_base,
        value_base,
        table_ptr,
        kv_base_row,
        tl.maximum(full_hi, part_lo),
        part_hi,
        scale_log2,
        window,
        kv_block_stride,
        kv_slot_stride,
        block_n,
        head_dim,
        block_size,
        paged,
        has_window,
        True,
        precision,
    )
    out_ptrs = out_ptr + q_rows[:, None] * out_token_stride + heads[:, None] * out_head_stride + dims[None, :]
    used = tl.cdiv(hi - lo, partition_len)
    if split and used > 1:
        # A row may see no key of this partition (its position is before it): sum 0, output 0.
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        parts = (q_rows * num_query_heads + heads) * num_splits
        counter = arrivals_ptr + program * tl.num_programs(1) + kv_head
        store_partition(out, row_max, row_sum, out_ptrs, part_out_ptr, part_max_ptr, part_sum_ptr, parts,
                        tl.program_id(2), counter, used, row_ok, dims, merge_chunk)  # fmt: skip
    else:  # one partition holds every visible key
        out = acc / row_sum[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    config: PrefillConfig | None = None,
    derived: dict[Any, Any] | None = None,
    pdl: bool = False,
    max_seq_len: int | None = None,
    split: DecodeSplit | None = None,
) -> torch.Tensor:
    """Packed queries ``[T, Hq, D]`` of any lengths (prefill, chunked prefill, decode, mixed) against
    the cached K/V of their sequences, the new tokens' K/V included (write them first).

    ``derived`` (e.g. ``AttentionMetadata.derived``) caches the tile map across layers; ``pdl`` launches
    the kernel programmatically dependent (``tokenmill.kernels.launch``). ``max_seq_len`` bounds
    ``seq_lens`` (as for decode attention, a CUDA graph passes the longest context it will see): given,
    a launch of few query tokens splits its keys over more programs (:func:`plan_prefill_split`; never
    with a window); ``split`` fixes that split instead (tests).
    """
    check_pools(query, key_pool, value_pool)
    return _prefill(
        query,
        (key_pool, value_pool),
        (key_pool.stride(0), key_pool.stride(1), key_pool.stride(2)),
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window,
        config,
        derived,
        block_size=key_pool.shape[1],
        pdl=pdl,
        max_context=None if sliding_window else max_seq_len,
        split=None if sliding_window else split,
    )


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    config: PrefillConfig | None = None,
    derived: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Packed whole sequences with no cache: sequence ``b``'s queries attend causally to its own keys,
    ``key``/``value`` ``[T, Hkv, D]`` (copied to one layout when their strides differ)."""
    if key.shape != value.shape or key.shape[0] != query.shape[0]:
        raise ValueError(f"key {list(key.shape)} / value {list(value.shape)} do not match the queries")
    if key.stride() != value.stride():  # e.g. a rotated key beside a value viewed from the fused QKV
        key, value = key.contiguous(), value.contiguous()
    for name, tensor in (("query", query), ("key", key)):
        require_unit_last_stride(name, tensor)
    if key.dtype != query.dtype:
        raise ValueError(f"query is {query.dtype} but key is {key.dtype}")
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    return _prefill(
        query,
        (key, value),
        (key.stride(0), 0, key.stride(1)),
        query_start_loc,  # unused block-table pointer
        query_start_loc,
        query_lens,  # no context: each sequence is just its queries
        scale,
        sliding_window,
        config,
        derived,
        block_size=0,
    )


def _prefill(
    query: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    kv_strides: tuple[int, int, int],
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    config: PrefillConfig | None,
    derived: dict[Any, Any] | None,
    block_size: int,
    pdl: bool = False,
    max_context: int | None = None,
    split: DecodeSplit | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv[0].shape[-2]
    group = num_heads // num_kv_heads
    config = config or default_prefill_config(head_dim, query.dtype)
    block_m = max(config.block_m, next_power_of_2(group), MIN_DOT_ROWS)
    tokens_per_tile = block_m // group
    tiles = cached_tiles(query_start_loc, num_tokens, tokens_per_tile, derived)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    num_programs = tiles.tile_seq.shape[0]
    if split is None:
        split = plan_prefill_split(
            num_tokens, num_programs * num_kv_heads, max_context, query.device, config.block_n
        )
    partials = decode_partials(
        num_tokens, num_programs * num_kv_heads, num_heads, split.num_splits, head_dim, query.device
    )
    _prefill_kernel[(num_programs, num_kv_heads, split.num_splits)](
        query,
        kv[0],
        kv[1],
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        tiles.tile_seq,
        tiles.tile_index,
        *partials,
        scale * LOG2E,
        sliding_window or 0,
        seq_lens.shape[0],
        num_heads,
        split.num_splits,
        split.min_partition,
        split.max_unsplit,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        *kv_strides,
        group=group,
        tokens_per_tile=tokens_per_tile,
        block_m=block_m,
        block_n=config.block_n,
        head_dim=head_dim,
        block_size=max(block_size, 1),
        paged=block_size > 0,
        has_window=bool(sliding_window),
        split=split.num_splits > 1,
        merge_chunk=max(1, MERGE_ELEMENTS // (block_m * head_dim)),
        precision=dot_precision(query.dtype),
        pdl=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out
