"""Paged KV cache bookkeeping: block allocation with refcounts, per-sequence block tables, and the pool.

The engine asks :class:`BlockManager` each step to grow or free sequences' tables, then builds the step's
``slot_mapping`` and ``block_tables`` tensors from it; the tensors index the pool from
:func:`allocate_kv_pool`.
"""

from tokenmill.cache.block_allocator import (
    BlockAllocator,
    BlockCacheHook,
    CacheIntegrityError,
    NoFreeBlocksError,
)
from tokenmill.cache.block_manager import BlockManager, SeqId, UnknownSequenceError
from tokenmill.cache.kv_pool import (
    allocate_kv_pool,
    kv_bytes_per_block,
    kv_bytes_per_token,
    num_blocks_for_budget,
)

__all__ = [
    "BlockAllocator",
    "BlockCacheHook",
    "BlockManager",
    "CacheIntegrityError",
    "NoFreeBlocksError",
    "SeqId",
    "UnknownSequenceError",
    "allocate_kv_pool",
    "kv_bytes_per_block",
    "kv_bytes_per_token",
    "num_blocks_for_budget",
]
