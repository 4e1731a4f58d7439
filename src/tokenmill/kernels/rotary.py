"""Rotary embedding applied in place to query and key, rotate-half layout (``models/layers/rotary.py``).

Each head's first half ``x1`` and second half ``x2`` become ``x1*cos - x2*sin`` and ``x2*cos + x1*sin``.
As in the PyTorch layer, cos/sin are cast to the activation dtype and every product and sum is rounded
to it, so low-precision results match the reference bit for bit.
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
    half: tl.constexpr,
    half_block: tl.constexpr,
    head_block: tl.constexpr,
) -> None:
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
        out1 = (a * cos).to(x1.dtype).to(tl.float32) - (b * sin).to(x1.dtype).to(tl.float32)
        out2 = (b * cos).to(x1.dtype).to(tl.float32) + (a * sin).to(x1.dtype).to(tl.float32)
        tl.store(ptrs, out1.to(x1.dtype), mask=mask)
        tl.store(ptrs + half, out2.to(x1.dtype), mask=mask)


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
    half: tl.constexpr,
    half_block: tl.constexpr,
    head_block: tl.constexpr,
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
    wait_for_previous_kernel(pdl)  # positions and the cos/sin table are the step's inputs: q/k are not
    query_base = query_ptr + token * query_token_stride
    _rotate_heads(query_base, query_head_stride, num_query_heads, cos, sin, half, half_block, head_block)
    key_base = key_ptr + token * key_token_stride
    _rotate_heads(key_base, key_head_stride, num_key_heads, cos, sin, half, half_block, head_block)


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
        half=head_dim // 2,
        half_block=half_block,
        head_block=max(1, head_block),
        pdl=pdl,
        num_warps=4,
        **launch_options(pdl),
    )
