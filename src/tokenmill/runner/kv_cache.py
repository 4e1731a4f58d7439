"""The engine's KV cache: the bookkeeping the scheduler calls, plus the per-layer pool tensors that attention
reads and writes, sized for the device (:mod:`tokenmill.runner.memory_profile` on CUDA).

``contiguous`` is the paged machinery with one block of ``max_model_len`` slots per sequence, so the
two modes differ only in what they reserve: a whole context per sequence, or 16 tokens at a time.
``none`` has a manager that keeps nothing and no pool.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.attention import KVCacheLayer
from tokenmill.cache.kv_cache_manager import KVCacheManager, create_kv_cache_manager
from tokenmill.cache.kv_pool import (
    allocate_kv_pool,
    kv_bytes_per_token,
    num_blocks_for_budget,
    sized_cpu_kv_budget,
)
from tokenmill.config import EngineConfig
from tokenmill.models import ModelConfig
from tokenmill.runner.memory_profile import ProfileForward, num_blocks_on_gpu

logger = logging.getLogger(__name__)


@dataclass
class KVCache:
    manager: KVCacheManager
    layers: list[KVCacheLayer] | None  # indexed by layer; None: nothing is cached
    bytes_per_token: int
    pool_tokens: int  # slots in the pool (0 without one)

    def used_bytes(self) -> int:
        """KV memory currently held by sequences (what a pool of just the right size would need)."""
        return self.manager.num_used_blocks * self.manager.block_size * self.bytes_per_token

    def pool_bytes(self) -> int:
        return self.pool_tokens * self.bytes_per_token


def create_kv_cache(
    config: EngineConfig,
    model: ModelConfig,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    profile_forward: ProfileForward | None = None,
    agree: Callable[[int], int] | None = None,
) -> KVCache:
    """The pool and its bookkeeping. On CUDA, unless ``num_kv_blocks`` is set, the pool takes what
    ``gpu_memory_utilization`` of the GPU leaves after the weights and the activations of the largest
    step, measured by running it through ``profile_forward``. ``agree``: under tensor parallelism, the
    smallest of the ranks' block counts (each rank sizes its own pool on its own GPU, profiling in step
    with the others; they must hold the same number of blocks, which rank 0's block tables index).
    ``dtype``: the model's; the pool stores K/V in it, or in float8 e4m3 under ``kv_cache_dtype`` fp8."""
    kv = config.kv
    dtype = cache_dtype(kv.kv_cache_dtype, dtype)
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    if kv.mode == "none":
        return KVCache(create_kv_cache_manager("none", 0, 1, False), None, per_token, 0)
    block_size = max_model_len if kv.mode == "contiguous" else kv.block_size
    shape = (block_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    if kv.num_blocks is not None:
        num_blocks = kv.num_blocks
    elif device.type == "cuda":
        num_blocks = num_blocks_on_gpu(config, shape, max_model_len, device, profile_forward)
    else:
        budget = _cpu_budget_bytes(config, per_token, block_size, max_model_len)
        num_blocks = num_blocks_for_budget(budget, *shape)
    if kv.mode == "contiguous":
        num_blocks = min(num_blocks, config.scheduler.max_running)
    if agree is not None:
        num_blocks = agree(num_blocks)
    tokens = num_blocks * block_size
    logger.info(
        "KV cache (%s): %d blocks of %d tokens = %d tokens, %.2f GiB",
        kv.mode, num_blocks, block_size, tokens, tokens * per_token / 2**30,
    )  # fmt: skip
    layers = allocate_kv_pool(
        model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype, device
    )
    manager = create_kv_cache_manager(kv.mode, num_blocks, block_size, bool(kv.prefix_caching))
    return KVCache(manager, layers, per_token, tokens)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for ``KVCacheConfig.kv_cache_dtype``."""
    return torch.float8_e4m3fn if kv_cache_dtype.startswith("fp8") else model_dtype


def _cpu_budget_bytes(config: EngineConfig, bytes_per_token: int, block_size: int, max_model_len: int) -> int:
    """``cpu_kv_cache_gib`` when set; else sized for ``max_num_seqs`` full-length sequences (capped)."""
    if config.kv.cpu_kv_cache_gib is not None:
        return int(config.kv.cpu_kv_cache_gib * 2**30)
    return sized_cpu_kv_budget(bytes_per_token, block_size, max_model_len, config.scheduler.max_running)
