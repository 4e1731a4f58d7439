"""The shapes, dtypes and layouts the attention kernels assume, checked before a launch."""

import torch

from tokenmill.kernels._common import require_unit_last_stride

FP8_KV_DTYPE = torch.float8_e4m3fn  # a pool of it is read into the query's dtype (kv_cache_dtype fp8)


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton attention kernels need a power-of-two head_dim >= 16, got {head_dim}")


def check_pools(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor) -> int:
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
    if key_pool.dtype not in (query.dtype, FP8_KV_DTYPE):
        raise ValueError(f"query is {query.dtype} but the KV pool is {key_pool.dtype}")
    for name, tensor in (("query", query), ("key_pool", key_pool)):
        require_unit_last_stride(name, tensor)
    return num_kv_heads
