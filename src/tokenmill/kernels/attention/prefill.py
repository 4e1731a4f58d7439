"""Prefill and mixed batches: packed queries of any lengths, each program a tile of consecutive query
tokens of one sequence (times the group's heads as rows); key tiles that every row sees skip the mask.
``varlen_attention`` runs the same kernel over packed whole sequences with no cache."""

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import cdiv, next_power_of_2, require_unit_last_stride
from tokenmill.kernels.attention.checks import check_pools
from tokenmill.kernels.attention.plan import MIN_DOT_ROWS, PrefillConfig, default_prefill_config
from tokenmill.kernels.attention.tiles import LOG2E, attend_range, dot_precision
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel


# Per-step values are not specialized on (Triton would compile a variant for 1 / multiples of 16 of each).
@triton.jit(do_not_specialize=["window", "num_seqs", "block_table_stride"])
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
    scale_log2: float,
    window: int,
    num_seqs: int,
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
        lo,
        full_lo,
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
        full_lo,
        full_hi,
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
        full_hi,
        hi,
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
    out = acc / row_sum[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * out_token_stride + heads[:, None] * out_head_stride
    tl.store(out_ptrs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


class PrefillTiles(NamedTuple):
    """Which (sequence, query tile) each program of the prefill grid takes; surplus programs get
    sequence ``num_seqs`` and exit."""

    tile_seq: torch.Tensor  # int32 [num_programs]
    tile_index: torch.Tensor  # int32 [num_programs]


def prefill_tiles(query_start_loc: torch.Tensor, num_tokens: int, tokens_per_tile: int) -> PrefillTiles:
    """The tile map, built on the device without a sync: the grid is the bound
    ``ceil(T / tokens_per_tile) + B`` on the tile count, whatever the query lengths are."""
    num_seqs = query_start_loc.shape[0] - 1
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    tiles = (query_lens + tokens_per_tile - 1) // tokens_per_tile
    tile_ends = torch.cumsum(tiles, 0)
    programs = torch.arange(cdiv(num_tokens, tokens_per_tile) + num_seqs, device=query_start_loc.device)
    tile_seq = torch.searchsorted(tile_ends, programs, right=True)
    first_tile = (tile_ends - tiles)[tile_seq.clamp(max=max(num_seqs - 1, 0))]
    return PrefillTiles(tile_seq.int(), (programs - first_tile).int())


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
) -> torch.Tensor:
    """Packed queries ``[T, Hq, D]`` of any lengths (prefill, chunked prefill, decode, mixed) against
    the cached K/V of their sequences, the new tokens' K/V included (write them first).

    ``derived`` (e.g. ``AttentionMetadata.derived``) caches the tile map across layers; ``pdl`` launches
    the kernel programmatically dependent (``tokenmill.kernels.launch``).
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
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // kv[0].shape[-2]
    config = config or default_prefill_config(head_dim, query.dtype)
    block_m = max(config.block_m, next_power_of_2(group), MIN_DOT_ROWS)
    tokens_per_tile = block_m // group
    tiles = _cached_tiles(query_start_loc, num_tokens, tokens_per_tile, derived)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    _prefill_kernel[(tiles.tile_seq.shape[0], kv[0].shape[-2])](
        query,
        kv[0],
        kv[1],
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        tiles.tile_seq,
        tiles.tile_index,
        scale * LOG2E,
        sliding_window or 0,
        seq_lens.shape[0],
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
        precision=dot_precision(query.dtype),
        pdl=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out


def _cached_tiles(
    query_start_loc: torch.Tensor, num_tokens: int, tokens_per_tile: int, derived: dict[Any, Any] | None
) -> PrefillTiles:
    if derived is None:
        return prefill_tiles(query_start_loc, num_tokens, tokens_per_tile)
    key = (PrefillTiles, num_tokens, tokens_per_tile)
    if key not in derived:
        derived[key] = prefill_tiles(query_start_loc, num_tokens, tokens_per_tile)
    tiles: PrefillTiles = derived[key]
    return tiles
