"""Causal attention over packed variable-length queries, reading K/V in place from the paged pool.

The pool is ``[num_blocks, block_size, Hkv, D]``; position ``p`` of sequence ``b`` lives in block
``block_tables[b, p // block_size]`` at offset ``p % block_size``. A query's absolute position is
``seq_len - query_len + i``; it sees keys ``p <= pos`` with ``p > pos - sliding_window`` when windowed.

Both kernels put the query heads that share a KV head into one program (GQA), so each K/V tile is loaded
once for the whole group, and keep a running (max, sum) softmax in base 2 (the scale folds in log2 e).

* Decode (one query per sequence): flash-decoding. Each sequence's context is cut into ``num_splits``
  equal partitions, one program per (sequence, KV head, partition), so a single long sequence still
  fills the GPU; the last program of a (sequence, KV head) to finish merges the partitions' partial
  outputs by their softmax maxima and sums (an arrival counter decides which: no second launch), and a
  context that fits one partition is written directly. The number of
  splits is fixed on the host from the batch size and a bound on the context (:func:`plan_decode_split`),
  the partition length on the device from each sequence's own length, so the launch is the same for
  every step of a CUDA graph while short contexts still spread over the splits.
  Keys of earlier steps are in the pool before the step starts, so each program loads its first tile of
  them before waiting for the kernels ahead (``kernels/launch.py``); the new token's key comes last. With
  ``new_tokens`` the kernel also stores the new K/V (no KV-write launch), and with ``rotation`` applies
  the rotary embedding to q and the new key on the way (no rotary launch).
* Prefill / mixed batches: each program takes a tile of consecutive query tokens of one sequence
  (times the group's heads as rows); key tiles that every row sees skip the mask.
"""

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import cdiv, next_power_of_2, require_unit_last_stride, sm_count
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel

LOG2E = math.log2(math.e)
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows on the GPU
# Split decode while the programs stay within about this many per SM (H200, graph replay: 4 per SM
# was best at batch 1 and 8; a batch of 64 already has 4 per SM unsplit, and splitting it cost 15%)...
DECODE_PROGRAMS_PER_SM = 4
DECODE_MIN_PARTITION = 128  # ...into partitions of the bound no shorter than this (keys)...
DECODE_MAX_SPLITS = 64  # ...and no more than this many.
# A context of up to this many keys stays one partition, with no merge of partials (Llama-3.2-1B
# batch-1 decode at 130-190 keys: +1.4% against partitions of 128).
DECODE_MAX_UNSPLIT = 256
MERGE_CHUNK = tl.constexpr(8)  # partitions a split merge reads per round of loads
# Bytes of keys (and as many of values) in a decode program's first tile, loaded before it waits, per
# warp, up to a partition: with 8 warps (small batches), a whole unsplit context of head_dim 64 (+1.1%
# at batch 1; a 256-key tile over 128-key partitions was 2.2-3.4% slower at 320-1088-key contexts).
PREFETCH_BYTES_PER_WARP = 4096


class PrefillConfig(NamedTuple):
    block_m: int  # rows of a query tile: tokens_per_tile * group (query tokens x heads of a group)
    block_n: int  # keys per step
    num_warps: int
    num_stages: int


class DecodeConfig(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int


class DecodeSplit(NamedTuple):
    """How decode attention cuts each sequence's context: into ``num_splits`` partitions of
    ``max(ceil(context / num_splits), min_partition)`` keys (rounded up to whole key tiles), the last
    ones empty when the context is short; a context of at most ``max_unsplit`` keys is one partition.
    All are launch parameters: for a CUDA graph they must come from values fixed at capture (see
    :func:`plan_decode_split`)."""

    num_splits: int
    min_partition: int  # keys, a multiple of the config's block_n
    max_unsplit: int = 0


class NewTokens(NamedTuple):
    """The decode step's own K/V, for the decode kernel to store (instead of a ``write_kv`` launch)."""

    key: torch.Tensor  # [B, Hkv, D]
    value: torch.Tensor  # [B, Hkv, D], the key's strides
    slot_mapping: torch.Tensor  # [B] flat pool slot of each token; -1 skips a row (padding)


class Rotation(NamedTuple):
    """The rotary embedding that the query and new key still need (rotate-half, full head dim)."""

    positions: torch.Tensor  # [B]
    cos_sin_cache: torch.Tensor  # [max_positions, D]: cos of the D/2 frequencies, then their sin


def default_prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    if dtype == torch.float32:  # exact (non-TF32) float32 dots need small tiles to avoid register spills
        return PrefillConfig(32, 32 if head_dim <= 128 else 16, 8, 1)
    if head_dim <= 128:  # two warpgroups: half the registers per thread of one (no spills at d=128)
        return PrefillConfig(128, 64, 8, 2)
    return PrefillConfig(64, 32, 8, 2)


def default_decode_config(
    head_dim: int, dtype: torch.dtype, num_seq_heads: int = 0, num_sms: int = 0
) -> DecodeConfig:
    """``num_seq_heads``: the launch's (sequence, KV head) pairs. While they are fewer than the ``num_sms``
    SMs (small batches) each program has an SM to itself, and 8 warps get through its short chain of
    loads and math sooner: +4% batch-1 decode of Llama-3.2-1B in the engine on the H200, where at batch
    64 (4 programs per SM) the configurations with 8 warps decoded 6-7% slower."""
    if dtype == torch.float32:  # see default_prefill_config
        return DecodeConfig(32 if head_dim <= 128 else 16, 8, 1)
    return DecodeConfig(64 if head_dim <= 128 else 32, 8 if num_seq_heads < num_sms else 4, 2)


# -- kernel building blocks -----------------------------------------------------------------------------


@triton.jit
def _kv_offsets(
    block_table_ptr: tl.tensor,
    kv_base_row: tl.tensor,
    positions: tl.tensor,
    in_range: tl.tensor,
    block_stride: int,
    slot_stride: int,
    paged: tl.constexpr,
    block_size: tl.constexpr,
) -> tl.tensor:
    """Element offsets of the K/V rows holding ``positions`` of one sequence: through its block-table
    row when paged, else rows ``kv_base_row + position`` of packed K/V (``block_stride`` = row stride)."""
    if paged:
        block_ids = tl.load(block_table_ptr + positions // block_size, mask=in_range, other=0).to(tl.int64)
        offsets = block_ids * block_stride + (positions % block_size) * slot_stride
    else:
        offsets = (kv_base_row + positions).to(tl.int64) * block_stride
    return offsets


@triton.jit
def _load_kv_tile(
    base_ptr: tl.tensor, offsets: tl.tensor, dims: tl.tensor, in_range: tl.tensor, masked: tl.constexpr
) -> tl.tensor:
    ptrs = base_ptr + offsets[:, None] + dims[None, :]
    return tl.load(ptrs, mask=in_range[:, None], other=0.0) if masked else tl.load(ptrs)


@triton.jit
def _softmax_step(
    scores: tl.tensor,
    row_max: tl.tensor,
    row_sum: tl.tensor,
    acc: tl.tensor,
    v: tl.tensor,
    precision: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Fold one tile of base-2 scores ``[M, N]`` and values ``[N, D]`` into the running max, sum and
    unnormalized output."""
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that has seen no visible key yet
    alpha = tl.exp2(row_max - safe_max)
    p = tl.exp2(scores - safe_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=precision)
    return new_max, row_sum, acc


@triton.jit
def _attend_range(
    q: tl.tensor,
    row_max: tl.tensor,
    row_sum: tl.tensor,
    acc: tl.tensor,
    query_pos: tl.tensor,
    key_base: tl.tensor,
    value_base: tl.tensor,
    block_table_ptr: tl.tensor,
    kv_base_row: tl.tensor,
    start_pos: tl.tensor,
    end_pos: tl.tensor,
    scale_log2: float,
    window: int,
    block_stride: int,
    slot_stride: int,
    block_n: tl.constexpr,
    head_dim: tl.constexpr,
    block_size: tl.constexpr,
    paged: tl.constexpr,
    has_window: tl.constexpr,
    masked: tl.constexpr,
    precision: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Attend the query rows to key positions ``[start_pos, end_pos)``; unless ``masked``, every row
    must see every one of them and the range must be a whole number of tiles."""
    dims = tl.arange(0, head_dim)
    for start in range(start_pos, end_pos, block_n):
        positions = start + tl.arange(0, block_n)
        in_range = positions < end_pos
        offsets = _kv_offsets(
            block_table_ptr, kv_base_row, positions, in_range, block_stride, slot_stride, paged, block_size
        )
        k = _load_kv_tile(key_base, offsets, dims, in_range, masked)
        scores = tl.dot(q, tl.trans(k), input_precision=precision) * scale_log2
        if masked:
            visible = (positions[None, :] <= query_pos[:, None]) & in_range[None, :]
            if has_window:
                visible = visible & (positions[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
        v = _load_kv_tile(value_base, offsets, dims, in_range, masked)
        row_max, row_sum, acc = _softmax_step(scores, row_max, row_sum, acc, v, precision)
    return row_max, row_sum, acc


# -- decode ---------------------------------------------------------------------------------------------


@triton.jit
def _context_range(seq_len: tl.tensor, window: int, has_window: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """First visible key position and the number of visible keys of a decode query at ``seq_len - 1``."""
    start = tl.maximum(seq_len - window, 0) if has_window else seq_len * 0
    return start, seq_len - start


@triton.jit
def _partition_length(
    context_len: tl.tensor, num_splits: int, min_partition: int, max_unsplit: int, block_n: tl.constexpr
) -> tl.tensor:
    """Keys per partition for this sequence: its context over the splits, in whole key tiles; the whole
    context when it is at most ``max_unsplit`` keys."""
    per_split = tl.maximum(tl.cdiv(tl.cdiv(context_len, num_splits), block_n) * block_n, min_partition)
    return tl.where(context_len <= max_unsplit, tl.cdiv(context_len, block_n) * block_n, per_split)


@triton.jit
def _attend_tile(
    q: tl.tensor,
    row_max: tl.tensor,
    row_sum: tl.tensor,
    acc: tl.tensor,
    k: tl.tensor,
    v: tl.tensor,
    in_range: tl.tensor,
    scale_log2: float,
    precision: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Fold a loaded tile of keys ``[N, D]`` and values into the running state; keys out of range
    (masked) count for nothing."""
    scores = tl.dot(q, tl.trans(k), input_precision=precision) * scale_log2
    scores = tl.where(in_range[None, :], scores, float("-inf"))
    return _softmax_step(scores, row_max, row_sum, acc, v, precision)


@triton.jit
def _attend_one_key(
    q: tl.tensor,
    row_max: tl.tensor,
    row_sum: tl.tensor,
    acc: tl.tensor,
    k: tl.tensor,
    v: tl.tensor,
    scale_log2: float,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Fold a single key ``[D]`` and value (the step's new token) into the running state, rounding the
    probability where ``_softmax_step`` does."""
    score = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * scale_log2
    new_max = tl.maximum(row_max, score)
    alpha = tl.exp2(row_max - new_max)
    p = tl.exp2(score - new_max)
    row_sum = row_sum * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]
    return new_max, row_sum, acc


@triton.jit
def _load_rotated(
    ptrs: tl.tensor,
    dims: tl.tensor,
    mask: tl.tensor,
    cos: tl.tensor,
    signed_sin: tl.tensor,
    head_dim: tl.constexpr,
    rotate: tl.constexpr,
) -> tl.tensor:
    """Rows at ``ptrs + dims`` (``dims`` spanning the head), rotated (rotate-half) by ``cos`` and
    ``signed_sin`` when ``rotate``: each product rounded to the activation dtype before the sum, as
    ``kernels/rotary.py`` and the PyTorch layer round."""
    x = tl.load(ptrs + dims, mask=mask, other=0.0)
    if rotate:
        partner = tl.load(ptrs + (dims + head_dim // 2) % head_dim, mask=mask, other=0.0)
        dtype = x.dtype
        x = (
            (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
            + (partner.to(tl.float32) * signed_sin).to(dtype).to(tl.float32)
        ).to(dtype)
    return x


@triton.jit(do_not_specialize=["window", "min_partition", "max_unsplit", "num_splits"])
def _decode_kernel(
    query_ptr: tl.tensor,
    key_pool_ptr: tl.tensor,
    value_pool_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
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
) -> None:
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start, context_len = _context_range(seq_len, window, has_window)
    partition_len = _partition_length(context_len, num_splits, min_partition, max_unsplit, block_n)
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
    first_offsets = _kv_offsets(
        table, 0, first, first_in_range, pool_block_stride, pool_slot_stride, True, block_size
    )
    first_k = _load_kv_tile(key_base, first_offsets, dims, first_in_range, True)
    first_v = _load_kv_tile(value_base, first_offsets, dims, first_in_range, True)
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
    q = _load_rotated(
        q_ptrs, dims[None, :], row_ok[:, None], cos[None, :], signed_sin[None, :], head_dim, rotate
    )
    row_max = tl.full([group_block], float("-inf"), tl.float32)
    row_sum = tl.zeros([group_block], tl.float32)
    acc = tl.zeros([group_block, head_dim], tl.float32)
    row_max, row_sum, acc = _attend_tile(
        q, row_max, row_sum, acc, first_k, first_v, first_in_range, scale_log2, precision
    )
    query_pos = tl.zeros([group_block], tl.int32) + seq_len - 1
    row_max, row_sum, acc = _attend_range(
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
        new_k, new_v = _new_token_kv(
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
        row_max, row_sum, acc = _attend_one_key(q, row_max, row_sum, acc, new_k, new_v, scale_log2)
    out = acc / row_sum[:, None]  # every partition that gets here holds at least one visible key
    used = tl.cdiv(context_len, partition_len)
    out_ptrs = out_ptr + seq * out_token_stride + heads[:, None] * out_head_stride + dims[None, :]
    if split and used > 1:
        parts = (seq * num_query_heads + heads) * num_splits
        tl.store(
            part_out_ptr + (parts + partition)[:, None] * head_dim + dims[None, :], out, mask=row_ok[:, None]
        )
        tl.store(part_max_ptr + parts + partition, row_max, mask=row_ok)
        tl.store(part_sum_ptr + parts + partition, row_sum, mask=row_ok)
        # The last partition to finish merges all of them: its acq_rel increment comes after every
        # other partition's release of its stores, so it sees them all. It resets the counter for the
        # next launch (the next layer, or the next replay of a graph).
        tl.debug_barrier()
        counter = arrivals_ptr + seq * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == used - 1:
            tl.atomic_xchg(counter, 0)
            out = _merge_partitions(part_out_ptr, part_max_ptr, part_sum_ptr, parts, row_ok, used, dims)
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # one partition holds the whole context
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _new_token_kv(
    new_key_ptrs: tl.tensor,
    new_value_ptrs: tl.tensor,
    key_base: tl.tensor,
    value_base: tl.tensor,
    table: tl.tensor,
    slot_ptr: tl.tensor,
    position: tl.tensor,
    dims: tl.tensor,
    cos: tl.tensor,
    signed_sin: tl.tensor,
    pool_block_stride: int,
    pool_slot_stride: int,
    block_size: tl.constexpr,
    write_new: tl.constexpr,
    rotate: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """The new token's key and value for one KV head: with ``write_new`` from the step's K/V (the key
    rotated when ``rotate``), stored into the pool at the token's slot (skipped for slot -1, a padding
    row); else read back from the pool, where the KV-write kernel put them."""
    if write_new:
        k = _load_rotated(new_key_ptrs, dims, dims < dims.shape[0], cos, signed_sin, dims.shape[0], rotate)
        k = k.to(key_base.dtype.element_ty)
        v = tl.load(new_value_ptrs + dims).to(value_base.dtype.element_ty)
        slot = tl.load(slot_ptr).to(tl.int64)
        offset = (slot // block_size) * pool_block_stride + (slot % block_size) * pool_slot_stride + dims
        tl.store(key_base + offset, k, mask=(dims * 0 + slot) >= 0)
        tl.store(value_base + offset, v, mask=(dims * 0 + slot) >= 0)
    else:
        block = tl.load(table + position // block_size).to(tl.int64)
        offset = block * pool_block_stride + (position % block_size) * pool_slot_stride + dims
        k = tl.load(key_base + offset)
        v = tl.load(value_base + offset)
    return k, v


@triton.jit
def _merge_partitions(
    part_out_ptr: tl.tensor,
    part_max_ptr: tl.tensor,
    part_sum_ptr: tl.tensor,
    parts: tl.tensor,
    row_ok: tl.tensor,
    used: tl.tensor,
    dims: tl.tensor,
) -> tl.tensor:
    """Partition ``j``'s output was normalized by its own sum: reweight by ``sum_j * 2^(max_j - max)``.
    Partitions are read ``MERGE_CHUNK`` at a time, so a short merge is one round of loads."""
    row_max = tl.full(parts.shape, float("-inf"), tl.float32)
    row_sum = tl.zeros(parts.shape, tl.float32)
    acc = tl.zeros([parts.shape[0], dims.shape[0]], tl.float32)
    for first in range(0, used, MERGE_CHUNK):
        chunk = first + tl.arange(0, MERGE_CHUNK)
        index = parts[:, None] + chunk[None, :]  # [rows, chunk]
        valid = row_ok[:, None] & (chunk < used)[None, :]
        # .cg: read from L2, where the other programs' stores are, not a stale L1 line.
        part_max = tl.load(part_max_ptr + index, mask=valid, other=float("-inf"), cache_modifier=".cg")
        part_sum = tl.load(part_sum_ptr + index, mask=valid, other=0.0, cache_modifier=".cg")
        part_out = tl.load(
            part_out_ptr + (index * dims.shape[0])[:, :, None] + dims[None, None, :],
            mask=valid[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        new_max = tl.maximum(row_max, tl.max(part_max, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # masked-off rows (past the group)
        alpha = tl.exp2(row_max - safe_max)
        weight = tl.exp2(part_max - safe_max[:, None]) * part_sum
        row_sum = row_sum * alpha + tl.sum(weight, 1)
        acc = acc * alpha[:, None] + tl.sum(part_out * weight[:, :, None], 1)
        row_max = new_max
    return acc / row_sum[:, None]


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
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = _check_pools(query, key_pool, value_pool)
    if rotation is not None and new_tokens is None:
        raise ValueError("a fused rotation needs new_tokens: the kernel rotates the key it writes")
    if new_tokens is not None:
        _check_new_tokens(new_tokens, num_seqs, num_kv_heads, head_dim)
    if rotation is not None:
        _check_rotation(rotation, num_seqs, head_dim)
    config = config or default_decode_config(
        head_dim, query.dtype, num_seqs * num_kv_heads, sm_count(query.device)
    )
    max_context = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
    if split is None:
        split = plan_decode_split(
            num_seqs, num_kv_heads, max_context, query.device, config.block_n, partition_size
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    partials = _decode_partials(num_seqs, num_kv_heads, num_heads, split.num_splits, head_dim, query.device)
    new_key, new_value, slot_mapping = new_tokens if new_tokens is not None else (query, query, seq_lens)
    positions, cos_sin = rotation if rotation is not None else (seq_lens, query)
    _decode_kernel[(num_seqs, num_kv_heads, split.num_splits)](
        query,
        key_pool,
        value_pool,
        block_tables,
        seq_lens,
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
        prefetch_n=_prefetch_keys(config, head_dim, query.dtype, split),
        block_size=key_pool.shape[1],
        has_window=bool(sliding_window),
        split=split.num_splits > 1,
        write_new=new_tokens is not None,
        rotate=rotation is not None,
        precision=_dot_precision(query.dtype),
        pdl=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out


def _check_new_tokens(new_tokens: NewTokens, num_seqs: int, num_kv_heads: int, head_dim: int) -> None:
    key, value, slot_mapping = new_tokens
    if key.shape != (num_seqs, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"new K/V {list(key.shape)} / {list(value.shape)} do not fit {num_seqs} decode rows")
    if value.stride()[1:] != key.stride()[1:] or slot_mapping.shape != (num_seqs,):
        raise ValueError("the new key and value need the same head layout and one slot per row")
    for name, tensor in (("new key", key), ("new value", value)):
        require_unit_last_stride(name, tensor)


def _prefetch_keys(config: DecodeConfig, head_dim: int, dtype: torch.dtype, split: DecodeSplit) -> int:
    """Keys in a decode program's first tile: as many whole key tiles as fit ``PREFETCH_BYTES_PER_WARP``
    per warp of 16-bit keys, no more than a partition of a split launch, or than an unsplit context when
    the launch is not split (a short partition or context is then one tile, loaded before the wait);
    one tile in float32, whose dots need small tiles."""
    if dtype == torch.float32:
        return config.block_n
    longest = split.min_partition if split.num_splits > 1 else max(split.min_partition, split.max_unsplit)
    keys = min(longest, PREFETCH_BYTES_PER_WARP * config.num_warps // (2 * head_dim))
    return max(config.block_n, keys // config.block_n * config.block_n)


def _check_rotation(rotation: Rotation, num_seqs: int, head_dim: int) -> None:
    positions, cos_sin_cache = rotation
    if cos_sin_cache.shape[-1] != head_dim or positions.shape != (num_seqs,):
        raise ValueError(
            f"rotation table {list(cos_sin_cache.shape)} and positions {list(positions.shape)} "
            f"do not fit {num_seqs} queries of head dim {head_dim}"
        )
    require_unit_last_stride("cos_sin_cache", cos_sin_cache)


def plan_decode_split(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    device: torch.device,
    block_n: int,
    partition_size: int | None = None,
) -> DecodeSplit:
    """The split-K plan of a decode launch, from launch-time constants only: the batch size, the KV
    heads, a bound on the visible context (``max_seq_len``, or the window when smaller) and the SM count.

    As many splits as keep ``num_seqs * num_kv_heads * num_splits`` programs within
    ``DECODE_PROGRAMS_PER_SM`` per SM, with partitions of the bound of at least ``DECODE_MIN_PARTITION``
    keys and at most ``DECODE_MAX_SPLITS``: one split (a single pass, no merge) once the batch fills
    the GPU alone, or when the bound is at most ``DECODE_MAX_UNSPLIT``. Each sequence then cuts its own
    context into that many partitions of at least ``DECODE_MIN_PARTITION`` keys (whole key tiles), and
    a context of at most ``DECODE_MAX_UNSPLIT`` keys is one partition, which needs no merge. A fixed
    ``partition_size`` instead splits the bound into partitions of that many keys, whatever the context.
    """
    if partition_size is not None:
        partition = cdiv(partition_size, block_n) * block_n
        return DecodeSplit(max(1, cdiv(max_context, partition)), partition)
    fitting = DECODE_PROGRAMS_PER_SM * sm_count(device) // max(1, num_seqs * num_kv_heads)
    splits = max(1, min(fitting, cdiv(max_context, DECODE_MIN_PARTITION), DECODE_MAX_SPLITS))
    if max_context <= DECODE_MAX_UNSPLIT:
        splits = 1
    return DecodeSplit(splits, cdiv(DECODE_MIN_PARTITION, block_n) * block_n, DECODE_MAX_UNSPLIT)


def _decode_partials(
    num_seqs: int, num_kv_heads: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-partition outputs (normalized), maxima and sums, and the arrival counters of the partitions
    of each (sequence, KV head); tiny placeholders when there is one split."""
    shape = (num_seqs, num_heads, num_splits) if num_splits > 1 else (1,)
    part_out = torch.empty(*shape, head_dim if num_splits > 1 else 1, dtype=torch.float32, device=device)
    part_max = torch.empty(shape, dtype=torch.float32, device=device)
    part_sum = torch.empty(shape, dtype=torch.float32, device=device)
    arrivals = _arrival_counters(device, num_seqs * num_kv_heads if num_splits > 1 else 1)
    return part_out, part_max, part_sum, arrivals


_ARRIVALS: dict[torch.device, torch.Tensor] = {}
MIN_ARRIVAL_COUNTERS = 4096  # more than a split launch needs (see plan_decode_split), so graphs find it


def _arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, kept from launch to launch: each merge leaves its counter at zero again.
    One buffer per device, made before any CUDA graph capture (the warm-up runs first)."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode attention needs more split counters during CUDA graph capture")
        counters = torch.zeros(max(count, MIN_ARRIVAL_COUNTERS), dtype=torch.int32, device=device)
        _ARRIVALS[device] = counters
    return counters


# -- prefill and mixed batches -------------------------------------------------------------------------


@triton.jit(do_not_specialize=["window", "num_seqs"])
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
) -> None:
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
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
    row_max, row_sum, acc = _attend_range(
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
    row_max, row_sum, acc = _attend_range(
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
    row_max, row_sum, acc = _attend_range(
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
) -> torch.Tensor:
    """Packed queries ``[T, Hq, D]`` of any lengths (prefill, chunked prefill, decode, mixed) against
    the cached K/V of their sequences, the new tokens' K/V included (write them first).

    ``derived`` (e.g. ``AttentionMetadata.derived``) caches the tile map across layers.
    """
    _check_pools(query, key_pool, value_pool)
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
        precision=_dot_precision(query.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
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


# -- checks ---------------------------------------------------------------------------------------------


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton attention kernels need a power-of-two head_dim >= 16, got {head_dim}")


def _check_pools(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor) -> int:
    """The number of KV heads, after checking the shapes, dtypes and layouts the kernels assume."""
    num_heads, head_dim = query.shape[1:]
    check_head_dim(head_dim)
    if key_pool.shape != value_pool.shape or key_pool.stride() != value_pool.stride():
        raise ValueError("the key and value pools must have the same shape and layout")
    num_kv_heads = key_pool.shape[2]
    if key_pool.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"pool {list(key_pool.shape)} does not fit {num_heads} query heads of dim {head_dim}"
        )
    if key_pool.dtype != query.dtype:
        raise ValueError(f"query is {query.dtype} but the KV pool is {key_pool.dtype}")
    for name, tensor in (("query", query), ("key_pool", key_pool)):
        require_unit_last_stride(name, tensor)
    return num_kv_heads


def _dot_precision(dtype: torch.dtype) -> str:
    """Full float32 products for float32 inputs (TF32 would miss the reference by ~1e-3)."""
    return "ieee" if dtype == torch.float32 else "tf32"
