"""Decode attention over a float8 pool on the float8 tensor cores: keys-major tiles.

A decode program's query rows are few (the heads of one KV-head group, padded to 16), too few for Hopper's
warpgroup MMA, which wants 64 rows; with so few rows Triton multiplies float8 tiles by converting them to
float16 first (one conversion per two elements, the cost that keeps the float8 pool from beating the
bfloat16 one). Transposed, the products have the keys as rows: scores^T = K q^T ([keys, heads]) and
out^T += V^T p^T ([head_dim, heads]), 64 or more rows each, so both can run as e4m3 x e4m3 MMAs. The query
is rounded to e4m3 after scaling each head's largest magnitude to 448 (the scale returns in the scores'
factor), and the probabilities are rounded to e4m3 for the second product.
"""

import triton
import triton.language as tl

from tokenmill.kernels.attention.tiles import kv_offsets, load_kv_tile

E4M3_MAX = tl.constexpr(448.0)  # e4m3's largest finite value


@triton.jit
def fold_keys_major(
    q_t: tl.tensor,
    factor: tl.tensor,
    row_max: tl.tensor,
    row_sum: tl.tensor,
    acc_t: tl.tensor,
    k: tl.tensor,
    v: tl.tensor,
    in_range: tl.tensor,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Fold keys ``k`` and values ``v`` ``[N, D]`` (e4m3; rows out of range count for nothing) into the
    running max and sum ``[M]`` and the transposed unnormalized output ``acc_t`` ``[D, M]``."""
    scores = tl.dot(k, q_t) * factor[None, :]  # [N, M], base 2
    scores = tl.where(in_range[:, None], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 0))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.exp2(row_max - safe_max)
    p = tl.exp2(scores - safe_max[None, :])
    row_sum = row_sum * alpha + tl.sum(p, 0)
    acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p.to(tl.float8e4nv))
    return new_max, row_sum, acc_t


@triton.jit
def attend_keys_major(
    q: tl.tensor,
    first_k: tl.tensor,
    first_v: tl.tensor,
    first_in_range: tl.tensor,
    key_base: tl.tensor,
    value_base: tl.tensor,
    table: tl.tensor,
    start_pos: tl.tensor,
    end_pos: tl.tensor,
    scale_log2: float,
    block_stride: int,
    slot_stride: int,
    block_n: tl.constexpr,
    head_dim: tl.constexpr,
    block_size: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """(row max, row sum, unnormalized output ``[M, D]``) of query rows ``q`` ``[M, D]`` over a loaded
    first tile and then the paged positions ``[start_pos, end_pos)``, every row seeing every key."""
    amax = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), 1e-30)
    to_e4m3 = tl.full(amax.shape, E4M3_MAX, tl.float32) / amax
    q_t = tl.trans((q.to(tl.float32) * to_e4m3[:, None]).to(tl.float8e4nv))
    factor = scale_log2 / to_e4m3
    row_max = tl.full([q.shape[0]], float("-inf"), tl.float32)
    row_sum = tl.zeros([q.shape[0]], tl.float32)
    acc_t = tl.zeros([head_dim, q.shape[0]], tl.float32)
    row_max, row_sum, acc_t = fold_keys_major(
        q_t, factor, row_max, row_sum, acc_t, first_k, first_v, first_in_range
    )
    dims = tl.arange(0, head_dim)
    for start in range(start_pos, end_pos, block_n):
        positions = start + tl.arange(0, block_n)
        in_range = positions < end_pos
        offsets = kv_offsets(table, 0, positions, in_range, block_stride, slot_stride, True, block_size)
        k = load_kv_tile(key_base, offsets, dims, in_range, True)
        v = load_kv_tile(value_base, offsets, dims, in_range, True)
        row_max, row_sum, acc_t = fold_keys_major(q_t, factor, row_max, row_sum, acc_t, k, v, in_range)
    return row_max, row_sum, tl.trans(acc_t)
