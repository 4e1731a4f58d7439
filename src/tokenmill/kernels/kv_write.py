"""Store the new tokens' K/V into the paged pool: token ``t`` goes to flat slot ``slot_mapping[t]``
(``block * block_size + offset``); slot -1 (a padding token) is skipped."""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2, require_unit_last_stride
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel


@triton.jit
def _write_kv_kernel(
    key_ptr: tl.tensor,
    value_ptr: tl.tensor,
    key_pool_ptr: tl.tensor,
    value_pool_ptr: tl.tensor,
    slot_mapping_ptr: tl.tensor,
    num_heads: int,
    key_token_stride: int,
    key_head_stride: int,
    value_token_stride: int,
    value_head_stride: int,
    pool_block_stride: int,
    pool_slot_stride: int,
    pool_head_stride: int,
    block_size: tl.constexpr,
    head_dim: tl.constexpr,
    block: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    wait_for_previous_kernel(pdl)
    # One program moves all heads of one token: element i is head i // head_dim, dim i % head_dim.
    offsets = tl.arange(0, block)
    heads = offsets // head_dim
    dims = offsets % head_dim
    mask = offsets < tl.where(slot >= 0, num_heads * head_dim, 0)
    pool_offsets = (slot // block_size) * pool_block_stride + (slot % block_size) * pool_slot_stride
    pool_offsets += heads * pool_head_stride + dims
    key = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + heads * value_head_stride + dims, mask=mask)
    tl.store(key_pool_ptr + pool_offsets, key.to(key_pool_ptr.dtype.element_ty), mask=mask)
    tl.store(value_pool_ptr + pool_offsets, value.to(value_pool_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    pdl: bool = False,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``[num_blocks, block_size, Hkv, D]`` pools."""
    num_tokens, num_heads, head_dim = key.shape
    if value.shape != key.shape or k_pool.shape != v_pool.shape or k_pool.shape[2:] != key.shape[1:]:
        raise ValueError(f"K/V {list(key.shape)} do not fit pools {list(k_pool.shape)}")
    if k_pool.stride() != v_pool.stride():
        raise ValueError("the key and value pools must have the same layout")
    for name, tensor in (("key", key), ("value", value), ("k_pool", k_pool)):
        require_unit_last_stride(name, tensor)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_pool,
        v_pool,
        slot_mapping,
        num_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        block_size=k_pool.shape[1],
        head_dim=head_dim,
        block=next_power_of_2(num_heads * head_dim),
        pdl=pdl,
        num_warps=4,
        **launch_options(pdl),
    )
