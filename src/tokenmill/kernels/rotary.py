"""Rotary embedding applied in place to query and key, rotate-half layout (``models/layers/rotary.py``).

Each head's first half ``x1`` and second half ``x2`` become ``x1*cos - x2*sin`` and ``x2*cos + x1*sin``.
As in the PyTorch layer, cos/sin are cast to the activation dtype and every product and sum is rounded
to it, so low-precision results match the reference bit for bit.

:func:`rotate_and_write_kv` also stores the rotated key and the value into the paged KV pool, as
``kernels/kv_write.py`` would after it: one launch a layer instead of two (prefill and verification
steps; decode steps do both inside the decode attention kernel).
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2, require_unit_last_stride
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel

ELEMENTS_PER_HEAD_BLOCK = 2048


@triton.jit
def _rotate_heads(
    base_ptr: tl.tensor,
    head_stride: int,
    num_heads: int,
    cos: tl.tensor,
    sin: tl.tensor,
    pool_ptr: tl.tensor,
    pool_head_stride: int,
    slot: tl.tensor,
    half: tl.constexpr,
    half_block: tl.constexpr,
    head_block: tl.constexpr,
    store_pool: tl.constexpr,
) -> None:
    """Rotate the heads at ``base_ptr`` in place; with ``store_pool`` also store them at ``pool_ptr`` in
    the pool's dtype, unless the token's ``slot`` is -1."""
    dims = tl.arange(0, half_block)
    for first_head in range(0, num_heads, head_block):
        heads = first_head + tl.arange(0, head_block)
        mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
        ptrs = base_ptr + heads[:, None] * head_stride + dims[None, :]
        x1 = tl.load(ptrs, mask=mask, other=0.0)
        x2 = tl.load(ptrs + half, mask=mask, other=0.0)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        # Each product is rounded to the activation dtype before the sum, as in the reference.
        out1 = ((a * cos).to(x1.dtype).to(tl.float32) - (b * sin).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        out2 = ((b * cos).to(x1.dtype).to(tl.float32) + (a * sin).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        tl.store(ptrs, out1, mask=mask)
        tl.store(ptrs + half, out2, mask=mask)
        if store_pool:
            pool_ptrs = pool_ptr + heads[:, None] * pool_head_stride + dims[None, :]
            pool_dtype = pool_ptr.dtype.element_ty
            # (slot >= 0 as a tensor of the tile's rows: the interpreter's masks must not be 0-d)
            to_pool = mask & ((heads * 0 + slot)[:, None] >= 0)
            tl.store(pool_ptrs, out1.to(pool_dtype), mask=to_pool)
            tl.store(pool_ptrs + half, out2.to(pool_dtype), mask=to_pool)


@triton.jit
def _copy_heads(
    src_ptr: tl.tensor,
    head_stride: int,
    num_heads: int,
    dst_ptr: tl.tensor,
    dst_head_stride: int,
    slot: tl.tensor,
    head_dim: tl.constexpr,
    head_block: tl.constexpr,
) -> None:
    """Store the heads at ``src_ptr`` at ``dst_ptr`` in its dtype (the value into the pool), unless the
    token's ``slot`` is -1."""
    dims = tl.arange(0, head_dim)
    for first_head in range(0, num_heads, head_block):
        heads = first_head + tl.arange(0, head_block)
        mask = ((heads < num_heads) & (heads * 0 + slot >= 0))[:, None] & (dims < head_dim)[None, :]
        x = tl.load(src_ptr + heads[:, None] * head_stride + dims[None, :], mask=mask)
        dst = dst_ptr + heads[:, None] * dst_head_stride + dims[None, :]
        tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr: tl.tensor,
    query_ptr: tl.tensor,
    key_ptr: tl.tensor,
    cos_sin_ptr: tl.tensor,
    query_token_stride: int,
    query_head_stride: int,
    key_token_stride: int,
    key_head_stride: int,
    cos_sin_stride: int,
    num_query_heads: int,
    num_key_heads: int,
    value_ptr: tl.tensor,
    key_pool_ptr: tl.tensor,
    value_pool_ptr: tl.tensor,
    slot_mapping_ptr: tl.tensor,
    value_token_stride: int,
    value_head_stride: int,
    pool_block_stride: int,
    pool_slot_stride: int,
    pool_head_stride: int,
    half: tl.constexpr,
    half_block: tl.constexpr,
    head_block: tl.constexpr,
    block_size: tl.constexpr,
    write_kv: tl.constexpr,  # also store the rotated key and the value at the token's slot (-1: none)
    pdl: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, half_block)
    cos_ptrs = cos_sin_ptr + position * cos_sin_stride + dims
    dtype = query_ptr.dtype.element_ty
    # Cast to the activation dtype first, as the reference does.
    cos = tl.load(cos_ptrs, mask=dims < half, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(cos_ptrs + half, mask=dims < half, other=0.0).to(dtype).to(tl.float32)[None, :]
    slot = token * 0 - 1
    if write_kv:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    pool_row = (slot // block_size) * pool_block_stride + (slot % block_size) * pool_slot_stride
    wait_for_previous_kernel(pdl)  # positions, slots and the cos/sin table are the step's inputs: q/k/v not
    query_base = query_ptr + token * query_token_stride
    _rotate_heads(query_base, query_head_stride, num_query_heads, cos, sin, query_base, 0, slot,
                  half, half_block, head_block, False)  # fmt: skip
    key_base = key_ptr + token * key_token_stride
    _rotate_heads(key_base, key_head_stride, num_key_heads, cos, sin, key_pool_ptr + pool_row,
                  pool_head_stride, slot, half, half_block, head_block, write_kv)  # fmt: skip
    if write_kv:
        _copy_heads(value_ptr + token * value_token_stride, value_head_stride, num_key_heads,
                    value_pool_ptr + pool_row, pool_head_stride, slot, 2 * half, head_block)  # fmt: skip


def apply_rotary_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    pdl: bool = False,
) -> None:
    """Rotate ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hkv, D]`` in place by ``positions`` ``[T]``.

    ``cos_sin_cache`` is ``[max_positions, D]``: cos of the ``D/2`` frequencies, then their sin. The
    tensors may be strided views (e.g. slices of a fused QKV output) if their last dimension is dense.
    """
    _rotary(positions, query, key, cos_sin_cache, pdl, None)


def rotate_and_write_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_pools: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    pdl: bool = False,
) -> None:
    """:func:`apply_rotary_`, then the rotated ``key`` and ``value`` into the ``[num_blocks, block_size,
    Hkv, D]`` pools at ``slot_mapping`` (slot -1: nowhere), as :func:`~tokenmill.kernels.kv_write.write_kv`
    stores them; one launch. The head dim must be a power of two (as the paged attention kernels' is)."""
    key_pool, value_pool = kv_pools
    if value.shape != key.shape or key_pool.shape != value_pool.shape or key_pool.shape[2:] != key.shape[1:]:
        raise ValueError(f"K/V {list(key.shape)} do not fit pools {list(key_pool.shape)}")
    if key_pool.stride() != value_pool.stride():
        raise ValueError("the key and value pools must have the same layout")
    if key.shape[2] & (key.shape[2] - 1):
        raise ValueError(f"head dim {key.shape[2]} is not a power of two")
    for name, tensor in (("value", value), ("key_pool", key_pool)):
        require_unit_last_stride(name, tensor)
    _rotary(positions, query, key, cos_sin_cache, pdl, (value, key_pool, value_pool, slot_mapping))


def _rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    pdl: bool,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    num_tokens, num_query_heads, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"shapes disagree: query {list(query.shape)}, key {list(key.shape)}")
    if query.dtype != key.dtype:
        raise ValueError(f"query is {query.dtype} but key is {key.dtype}")
    if cos_sin_cache.shape[-1] != head_dim or head_dim % 2:
        raise ValueError(f"rotary dim {cos_sin_cache.shape[-1]} must equal the (even) head dim {head_dim}")
    for name, tensor in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        require_unit_last_stride(name, tensor)
    if num_tokens == 0:
        return
    # Without K/V to write, the key stands in for their tensors (never read).
    value, key_pool, value_pool, slot_mapping = kv if kv is not None else (key, key, key, positions)
    half_block = next_power_of_2(head_dim // 2)
    head_block = min(
        next_power_of_2(max(num_query_heads, key.shape[1])), ELEMENTS_PER_HEAD_BLOCK // half_block
    )
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        num_query_heads,
        key.shape[1],
        value,
        key_pool,
        value_pool,
        slot_mapping,
        value.stride(0),
        value.stride(1),
        key_pool.stride(0),
        key_pool.stride(1),
        key_pool.stride(2),
        half=head_dim // 2,
        half_block=half_block,
        head_block=max(1, head_block),
        block_size=key_pool.shape[1] if kv is not None else 1,
        write_kv=kv is not None,
        pdl=pdl,
        num_warps=4,
        **launch_options(pdl),
    )
