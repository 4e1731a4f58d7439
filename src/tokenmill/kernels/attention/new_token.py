"""The decode step's own token: the decode kernel rotates the query and the new key (no rotary launch),
stores the new K/V into the pool (no KV-write launch) and folds them in from registers."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import require_unit_last_stride
from tokenmill.kernels.attention.tiles import as_operand, to_pool


class NewTokens(NamedTuple):
    """The decode step's own K/V, for the decode kernel to store (instead of a ``write_kv`` launch)."""

    key: torch.Tensor  # [B, Hkv, D]
    value: torch.Tensor  # [B, Hkv, D], the key's strides
    slot_mapping: torch.Tensor  # [B] flat pool slot of each token; -1 skips a row (padding)


class Rotation(NamedTuple):
    """The rotary embedding that the query and new key still need (rotate-half, full head dim)."""

    positions: torch.Tensor  # [B]
    cos_sin_cache: torch.Tensor  # [max_positions, D]: cos of the D/2 frequencies, then their sin


@triton.jit
def attend_one_key(
    q: tl.tensor,
    row_max: tl.tensor,
    row_sum: tl.tensor,
    acc: tl.tensor,
    k: tl.tensor,
    v: tl.tensor,
    scale_log2: float,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Fold a single key ``[D]`` and value (the step's new token, in the pool's dtype) into the running
    state, rounding the probability where ``tiles.softmax_step`` does."""
    k = as_operand(k, q.dtype).to(tl.float32)
    score = tl.sum(q.to(tl.float32) * k[None, :], axis=1) * scale_log2
    new_max = tl.maximum(row_max, score)
    alpha = tl.exp2(row_max - new_max)
    p = tl.exp2(score - new_max)
    row_sum = row_sum * alpha + p
    v = as_operand(v, q.dtype).to(tl.float32)
    acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v[None, :]
    return new_max, row_sum, acc


@triton.jit
def load_rotated(
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


@triton.jit
def new_token_kv(
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
        k = load_rotated(new_key_ptrs, dims, dims < dims.shape[0], cos, signed_sin, dims.shape[0], rotate)
        k = to_pool(k, key_base)
        v = to_pool(tl.load(new_value_ptrs + dims), value_base)
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


def check_new_tokens(new_tokens: NewTokens, num_seqs: int, num_kv_heads: int, head_dim: int) -> None:
    key, value, slot_mapping = new_tokens
    if key.shape != (num_seqs, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"new K/V {list(key.shape)} / {list(value.shape)} do not fit {num_seqs} decode rows")
    if value.stride()[1:] != key.stride()[1:] or slot_mapping.shape != (num_seqs,):
        raise ValueError("the new key and value need the same head layout and one slot per row")
    for name, tensor in (("new key", key), ("new value", value)):
        require_unit_last_stride(name, tensor)


def check_rotation(rotation: Rotation, num_seqs: int, head_dim: int) -> None:
    positions, cos_sin_cache = rotation
    if cos_sin_cache.shape[-1] != head_dim or positions.shape != (num_seqs,):
        raise ValueError(
            f"rotation table {list(cos_sin_cache.shape)} and positions {list(positions.shape)} "
            f"do not fit {num_seqs} queries of head dim {head_dim}"
        )
    require_unit_last_stride("cos_sin_cache", cos_sin_cache)
