"""The engine's KV cache: the per-layer pool tensors plus the block bookkeeping, per ``kv_cache`` mode.

``contiguous`` is the paged machinery with one block of ``max_model_len`` slots per sequence, so the
two modes differ only in what they reserve: a whole context per sequence, or 16 tokens at a time.
"""

import logging
from dataclasses import dataclass

import torch

from tokenmill.attention import KVCacheLayer
from tokenmill.cache.block_manager import BlockManager
from tokenmill.cache.kv_pool import (
    allocate_kv_pool,
    kv_bytes_per_token,
    num_blocks_for_budget,
    num_blocks_from_gpu_memory,
)
from tokenmill.engine.config import EngineConfig
from tokenmill.models import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class KVCache:
    manager: BlockManager
    layers: list[KVCacheLayer]
    bytes_per_token: int

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.manager.num_blocks * self.manager.block_size

    def reserved_bytes(self) -> int:
        """KV memory currently held by sequences (what a pool of just the right size would need)."""
        return self.manager.allocator.num_used * self.block_size * self.bytes_per_token

    def pool_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token


def create_kv_cache(
    config: EngineConfig, model: ModelConfig, max_model_len: int, device: torch.device, dtype: torch.dtype
) -> KVCache | None:
    if config.kv_cache == "none":
        return None
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    block_size = max_model_len if config.kv_cache == "contiguous" else config.block_size
    num_blocks = _num_blocks(config, model, block_size, dtype, device)
    if config.kv_cache == "contiguous":
        num_blocks = min(num_blocks, config.max_running)
    tokens = num_blocks * block_size
    logger.info(
        "KV cache (%s): %d blocks of %d tokens = %d tokens, %.1f MiB",
        config.kv_cache, num_blocks, block_size, tokens, tokens * per_token / 2**20,
    )  # fmt: skip
    layers = allocate_kv_pool(
        model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype, device
    )
    return KVCache(BlockManager(num_blocks, block_size), layers, per_token)


def _num_blocks(
    config: EngineConfig, model: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device
) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    shape = (block_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    if device.type == "cuda":
        return num_blocks_from_gpu_memory(config.gpu_memory_utilization, *shape, device=device)
    return num_blocks_for_budget(int(config.cpu_kv_cache_gib * 2**30), *shape)
