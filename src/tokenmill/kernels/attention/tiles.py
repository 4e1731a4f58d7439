"""The key-tile loop that the decode and prefill kernels share: the K/V rows of a tile found through a
block table (or packed, unpaged), the tile loaded (masked or whole) and converted to the query's dtype
(a float8 pool, ``kv_cache_dtype`` fp8, is read as it is stored; viewed as int8 under 16-bit queries,
its e4m3 codes become float16 operands, see :func:`load_code_tile`), and folded into a running base-2
softmax (row max, row sum, unnormalized output)."""

import math

import torch
import triton
import triton.language as tl

from tokenmill.kernels import interpreter_enabled

LOG2E = math.log2(math.e)  # the softmax runs in base 2: launchers pass the scale times log2 e
COMPILED = tl.constexpr(not interpreter_enabled())


@triton.jit
def as_operand(tile: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """A K/V tile (or the new token's key or value) as a dot operand of ``dtype``; int8 e4m3 codes (a
    float8 pool viewed as int8) become float16, exactly, whatever ``dtype`` (the query is float16 then)."""
    if tile.dtype == tl.int8:
        return tile.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tile.to(dtype)


@triton.jit
def float16_query(q: tl.tensor, scale_log2: float) -> tuple[tl.tensor, float]:
    """16-bit queries as float16, for products with a float8 pool's tiles in float16: scaled by a power
    of two that keeps the largest within ``2**14`` (float16 ends at 65,504), and the scores' scale that
    undoes it."""
    q32 = q.to(tl.float32)
    shift = tl.maximum(tl.ceil(tl.log2(tl.max(tl.max(tl.abs(q32), 1), 0))) - 14.0, 0.0)
    return (q32 * tl.exp2(-shift)).to(tl.float16), scale_log2 * tl.exp2(shift)


@triton.jit
def to_pool(x: tl.tensor, pool_ptr: tl.tensor) -> tl.tensor:
    """``x`` in the pool's element type; for a float8 pool viewed as int8, its e4m3 codes."""
    if pool_ptr.dtype.element_ty == tl.int8:
        return x.to(tl.float8e4nv).to(tl.int8, bitcast=True)
    return x.to(pool_ptr.dtype.element_ty)


@triton.jit
def kv_offsets(
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
def load_kv_tile(
    base_ptr: tl.tensor, offsets: tl.tensor, dims: tl.tensor, in_range: tl.tensor, masked: tl.constexpr
) -> tl.tensor:
    if base_ptr.dtype.element_ty == tl.int8:
        tile = load_code_tile(base_ptr, offsets, dims, in_range, masked)
    else:
        ptrs = base_ptr + offsets[:, None] + dims[None, :]
        tile = tl.load(ptrs, mask=in_range[:, None], other=0.0) if masked else tl.load(ptrs)
    return tile


@triton.jit
def load_code_tile(
    base_ptr: tl.tensor, offsets: tl.tensor, dims: tl.tensor, in_range: tl.tensor, masked: tl.constexpr
) -> tl.tensor:
    """A float8 pool's tile (viewed as int8) as float16 ``[N, D]``: read as 16-bit pairs of e4m3 codes,
    each pair converted by one instruction. Converted before the tile reaches the products, where the
    value tile of a pool of bytes would be read from shared memory a byte at a time (the products need
    it transposed, which ``ldmatrix`` does for 16-bit elements only)."""
    pairs = tl.arange(0, dims.shape[0] // 2)
    ptrs = base_ptr.to(tl.pointer_type(tl.int16)) + offsets[:, None] // 2 + pairs[None, :]
    words = tl.load(ptrs, mask=in_range[:, None], other=0) if masked else tl.load(ptrs)
    if COMPILED:
        low, high = tl.inline_asm_elementwise(
            "{ .reg .b32 r; cvt.rn.f16x2.e4m3x2 r, $2; mov.b32 {$0, $1}, r; }",
            "=h,=h,h",
            [words],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:  # Triton's interpreter runs no PTX
        low = words.to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        high = (words >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.reshape(tl.join(low, high), (offsets.shape[0], dims.shape[0]))


@triton.jit
def softmax_step(
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
def attend_range(
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
        offsets = kv_offsets(
            block_table_ptr, kv_base_row, positions, in_range, block_stride, slot_stride, paged, block_size
        )
        k = as_operand(load_kv_tile(key_base, offsets, dims, in_range, masked), q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=precision) * scale_log2
        if masked:
            visible = (positions[None, :] <= query_pos[:, None]) & in_range[None, :]
            if has_window:
                visible = visible & (positions[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
        v = as_operand(load_kv_tile(value_base, offsets, dims, in_range, masked), q.dtype)
        row_max, row_sum, acc = softmax_step(scores, row_max, row_sum, acc, v, precision)
    return row_max, row_sum, acc


@triton.jit
def attend_tile(
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
    """Fold a loaded tile of keys ``[N, D]`` and values (in the pool's dtype) into the running state;
    keys out of range (masked) count for nothing."""
    scores = tl.dot(q, tl.trans(as_operand(k, q.dtype)), input_precision=precision) * scale_log2
    scores = tl.where(in_range[None, :], scores, float("-inf"))
    return softmax_step(scores, row_max, row_sum, acc, as_operand(v, q.dtype), precision)


def dot_precision(dtype: torch.dtype) -> str:
    """Full float32 products for float32 inputs (TF32 would miss the reference by ~1e-3)."""
    return "ieee" if dtype == torch.float32 else "tf32"
