"""Decode attention, one query per sequence: flash-decoding over the paged pool, one program per
(sequence, KV head, partition); see the package docstring."""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2, sm_count
from tokenmill.kernels.attention.checks import FP8_KV_DTYPE, check_pools
from tokenmill.kernels.attention.new_token import (
    NewTokens,
    Rotation,
    attend_one_key,
    check_new_tokens,
    check_rotation,
    load_rotated,
    new_token_kv,
)
from tokenmill.kernels.attention.partitions import (
    MERGE_CHUNK,
    context_range,
    decode_partials,
    partition_length,
    store_partition,
)
from tokenmill.kernels.attention.plan import (
    MIN_DOT_ROWS,
    DecodeConfig,
    DecodeSplit,
    default_decode_config,
    launch_waves,
    plan_decode_split,
    prefetch_keys,
)
from tokenmill.kernels.attention.tiles import (
    LOG2E,
    attend_range,
    attend_tile,
    dot_precision,
    float16_query,
    kv_offsets,
    load_kv_tile,
)
from tokenmill.kernels.launch import launch_options, register_limit, wait_for_previous_kernel

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension, the sequences of a decode launch


@triton.jit(do_not_specialize=["window", "min_partition", "max_unsplit", "num_splits"])
def _decode_kernel(
    query_ptr: tl.tensor,
    key_pool_ptr: tl.tensor,
    value_pool_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    order_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_out_ptr: tl.tensor,
    part_max_ptr: tl.tensor,
    part_sum_ptr: tl.tensor,
    arrivals_ptr: tl.tensor,
    new_key_ptr: tl.tensor,
    new_value_ptr: tl.tensor,
    slot_mapping_ptr: tl.tensor,
    positions_ptr: tl.tensor,
    cos_sin_ptr: tl.tensor,
    scale_log2: float,
    window: int,
    min_partition: int,
    max_unsplit: int,
    num_query_heads: int,
    num_splits: int,
    query_token_stride: int,
    query_head_stride: int,
    new_key_token_stride: int,
    new_value_token_stride: int,
    new_head_stride: int,
    cos_sin_stride: int,
    out_token_stride: int,
    out_head_stride: int,
    block_table_stride: int,
    pool_block_stride: int,
    pool_slot_stride: int,
    pool_head_stride: int,
    group: tl.constexpr,
    group_block: tl.constexpr,
    head_dim: tl.constexpr,
    block_n: tl.constexpr,
    prefetch_n: tl.constexpr,  # keys of the first tile (loaded before the wait), a multiple of block_n
    block_size: tl.constexpr,
    has_window: tl.constexpr,
    split: tl.constexpr,
    write_new: tl.constexpr,  # the new token's K/V come in new_key/new_value and are stored here
    rotate: tl.constexpr,  # q and the new key still need their rotary embedding (needs write_new)
    precision: tl.constexpr,
    pdl: tl.constexpr,
    ordered: tl.constexpr,  # the sequences come in order_ptr's order (longest first), not row by row
) -> None:
    kv_head = tl.program_id(0)  # a sequence's KV heads are launched side by side
    seq = tl.program_id(1).to(tl.int64)
    if ordered:
        seq = tl.load(order_ptr + seq).to(tl.int64)
    partition = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start, context_len = context_range(seq_len, window, has_window)
    partition_len = partition_length(context_len, num_splits, min_partition, max_unsplit, block_n)
    lo = context_start + partition * partition_len
    if lo >= seq_len:  # past this sequence's context: the merge does not read this partition
        return
    hi = tl.minimum(lo + partition_len, seq_len)

    # Keys before the new token were written by earlier steps, which no kernel of this step touches: the
    # first tile of them is loaded before waiting for the kernels ahead (with PDL, while they finish).
    key_base = key_pool_ptr + kv_head * pool_head_stride
    value_base = value_pool_ptr + kv_head * pool_head_stride
    table = block_tables_ptr + seq * block_table_stride
    dims = tl.arange(0, head_dim)
    cached_hi = tl.minimum(hi, seq_len - 1)
    first = lo + tl.arange(0, prefetch_n)
    first_in_range = first < tl.minimum(lo + prefetch_n, cached_hi)
    first_offsets = kv_offsets(
        table, 0, first, first_in_range, pool_block_stride, pool_slot_stride, True, block_size
    )
    first_k = load_kv_tile(key_base, first_offsets, dims, first_in_range, True)
    first_v = load_kv_tile(value_base, first_offsets, dims, first_in_range, True)
    cos = tl.zeros([head_dim], tl.float32)
    signed_sin = tl.zeros([head_dim], tl.float32)
    if rotate:
        position = tl.load(positions_ptr + seq).to(tl.int64)
        angle = cos_sin_ptr + position * cos_sin_stride + dims % (head_dim // 2)
        dtype = query_ptr.dtype.element_ty
        cos = tl.load(angle).to(dtype).to(tl.float32)
        signed_sin = tl.load(angle + head_dim // 2).to(dtype).to(tl.float32) * tl.where(
            dims < head_dim // 2, -1.0, 1.0
        )
    wait_for_previous_kernel(pdl)  # q and the new K/V come from the kernels before this one

    rows = tl.arange(0, group_block)  # row r is query head kv_head * group + r
    heads = kv_head * group + rows
    row_ok = rows < group
    q_ptrs = query_ptr + seq * query_token_stride + heads[:, None] * query_head_stride
    q = load_rotated(
        q_ptrs, dims[None, :], row_ok[:, None], cos[None, :], signed_sin[None, :], head_dim, rotate
    )
    if key_pool_ptr.dtype.element_ty == tl.int8:  # a float8 pool's codes: float16 products (tiles.py)
        q, scale_log2 = float16_query(q, scale_log2)
    row_max = tl.full([group_block], float("-inf"), tl.float32)
    row_sum = tl.zeros([group_block], tl.float32)
    acc = tl.zeros([group_block, head_dim], tl.float32)
    row_max, row_sum, acc = attend_tile(
        q, row_max, row_sum, acc, first_k, first_v, first_in_range, scale_log2, precision
    )
    query_pos = tl.zeros([group_block], tl.int32) + seq_len - 1
    row_max, row_sum, acc = attend_range(
        q,
        row_max,
        row_sum,
        acc,
        query_pos,
        key_base,
        value_base,
        table,
        0,
        lo + prefetch_n,
        cached_hi,
        scale_log2,
        window,
        pool_block_stride,
        pool_slot_stride,
        block_n,
        head_dim,
        block_size,
        True,
        False,  # the window is already applied through lo
        True,
        precision,
    )
    if hi == seq_len:  # this partition holds the new token
        new_k, new_v = new_token_kv(
            new_key_ptr + seq * new_key_token_stride + kv_head * new_head_stride,
            new_value_ptr + seq * new_value_token_stride + kv_head * new_head_stride,
            key_base,
            value_base,
            table,
            slot_mapping_ptr + seq,
            seq_len - 1,
            dims,
            cos,
            signed_sin,
            pool_block_stride,
            pool_slot_stride,
            block_size,
            write_new,
            rotate,
        )
        row_max, row_sum, acc = attend_one_key(q, row_max, row_sum, acc, new_k, new_v, scale_log2)
    out = acc / row_sum[:, None]  # every partition that gets here holds at least one visible key
    used = tl.cdiv(context_len, partition_len)
    out_ptrs = out_ptr + seq * out_token_stride + heads[:, None] * out_head_stride + dims[None, :]
    if split and used > 1:
        parts = (seq * num_query_heads + heads) * num_splits
        counter = arrivals_ptr + seq * tl.num_programs(0) + kv_head
        store_partition(out, row_max, row_sum, out_ptrs, part_out_ptr, part_max_ptr, part_sum_ptr, parts,
                        partition, counter, used, row_ok, dims, MERGE_CHUNK)  # fmt: skip
    else:  # one partition holds the whole context
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_decode_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    partition_size: int | None = None,
    config: DecodeConfig | None = None,
    split: DecodeSplit | None = None,
    pdl: bool = False,
    new_tokens: NewTokens | None = None,
    rotation: Rotation | None = None,
    fp8_codes: bool = True,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``query`` ``[B, Hq, D]`` → ``[B, Hq, D]``.

    ``max_seq_len`` bounds ``seq_lens`` (no device sync); with ``B`` it fixes the launch (grid, splits),
    so a CUDA graph captured with ``max_seq_len`` = the longest context it will see (``max_model_len``)
    replays correctly for any shorter one. ``partition_size`` fixes the keys per split-K program and
    ``split`` the whole split (tuning and tests); by default :func:`plan_decode_split` chooses.

    Without ``new_tokens`` the pool already holds every key, the new token's too (``write_kv`` ran).
    With it, the kernel stores the new token's K/V itself and folds them in from registers; with
    ``rotation`` as well, ``query`` and the new key arrive before their rotary embedding and the kernel
    applies it (the query is not written back). Both save a launch per layer.

    A float8 pool under 16-bit queries is read, when ``fp8_codes`` (the default; off only to measure
    the difference), as int8 e4m3 codes converted in pairs to float16, the products in float16
    (``tiles.load_code_tile``): 201 -> 146 µs a layer at 178 sequences of 300-1,500 keys on the H200
    (with the default config's register cap), where a bfloat16 pool takes 169
    (``reports/gpu/quantized-llama-3.1-8b/kv-fp8/``). Without it, each tile is converted to the
    query's dtype.

    ``order`` (int32 ``[B]``, a permutation of the rows, longest context first) is the order in which
    the sequences' programs are launched when an unsplit launch takes more than one wave of the GPU: the
    longest start first and the short ones fill in behind them, where row order can leave a tail of
    long programs on a few SMs (H200, 178 sequences of 300-1,500 keys, 32 / 8 heads: float8 pool 146.7 ->
    125.0 µs, bf16 168.9 -> 159.3; ``reports/gpu/quantized-llama-3.1-8b/decode-order/``). Otherwise ignored.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = check_pools(query, key_pool, value_pool)
    if num_seqs > MAX_GRID_Y:
        raise ValueError(f"a decode launch takes at most {MAX_GRID_Y} sequences, got {num_seqs}")
    if rotation is not None and new_tokens is None:
        raise ValueError("a fused rotation needs new_tokens: the kernel rotates the key it writes")
    if new_tokens is not None:
        check_new_tokens(new_tokens, num_seqs, num_kv_heads, head_dim)
    if rotation is not None:
        check_rotation(rotation, num_seqs, head_dim)
    config = config or default_decode_config(
        head_dim, query.dtype, num_seqs * num_kv_heads, sm_count(query.device), key_pool.dtype
    )
    max_context = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
    if split is None:
        split = plan_decode_split(
            num_seqs, num_kv_heads, max_context, query.device, config.block_n, partition_size
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if fp8_codes and key_pool.dtype == FP8_KV_DTYPE and query.dtype.itemsize == 2:
        key_pool, value_pool = key_pool.view(torch.int8), value_pool.view(torch.int8)
    partials = decode_partials(
        num_seqs, num_seqs * num_kv_heads, num_heads, split.num_splits, head_dim, query.device
    )
    new_key, new_value, slot_mapping = new_tokens if new_tokens is not None else (query, query, seq_lens)
    positions, cos_sin = rotation if rotation is not None else (seq_lens, query)
    waves = launch_waves(num_seqs * num_kv_heads, query.device)
    ordered = order is not None and split.num_splits == 1 and waves > 1
    _decode_kernel[(num_kv_heads, num_seqs, split.num_splits)](
        query,
        key_pool,
        value_pool,
        block_tables,
        seq_lens,
        order if ordered else seq_lens,
        out,
        *partials,
        new_key,
        new_value,
        slot_mapping,
        positions,
        cos_sin,
        scale * LOG2E,
        sliding_window or 0,
        split.min_partition,
        split.max_unsplit,
        num_heads,
        split.num_splits,
        query.stride(0),
        query.stride(1),
        new_key.stride(0),
        new_value.stride(0),
        new_key.stride(1),
        cos_sin.stride(0),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_pool.stride(0),
        key_pool.stride(1),
        key_pool.stride(2),
        group=num_heads // num_kv_heads,
        group_block=max(MIN_DOT_ROWS, next_power_of_2(num_heads // num_kv_heads)),
        head_dim=head_dim,
        block_n=config.block_n,
        prefetch_n=prefetch_keys(config, head_dim, query.dtype, split),
        block_size=key_pool.shape[1],
        has_window=bool(sliding_window),
        split=split.num_splits > 1,
        write_new=new_tokens is not None,
        rotate=rotation is not None,
        precision=dot_precision(query.dtype),
        pdl=pdl,
        ordered=ordered,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
        **register_limit(config.max_registers, query.is_cuda),
    )
    return out
