"""The engine's KV cache: the per-layer pool tensors plus the block bookkeeping, per ``kv_cache`` mode.

``contiguous`` is the paged machinery with one block of ``max_model_len`` slots per sequence, so the
two modes differ only in what they reserve: a whole context per sequence, or 16 tokens at a time.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.attention import KVCacheLayer
from tokenmill.cache.block_manager import BlockManager
from tokenmill.cache.kv_pool import (
    allocate_kv_pool,
    kv_budget_bytes,
    kv_bytes_per_token,
    num_blocks_for_budget,
    num_blocks_for_device_memory,
    read_device_memory,
)
from tokenmill.config import EngineConfig
from tokenmill.models import ModelConfig
from tokenmill.runner.cuda_graphs import GRAPH_LOGITS_MAX_ROWS, cuda_graph_sizes

logger = logging.getLogger(__name__)
_GIB = 2**30


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


# Runs a forward pass of (tokens, longest sequence) without a KV cache and samples (rows) of it.
ProfileForward = Callable[[int, int, int], None]


def create_kv_cache(
    config: EngineConfig,
    model: ModelConfig,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    profile_forward: ProfileForward | None = None,
) -> KVCache | None:
    """The pool and its bookkeeping. On CUDA, unless ``num_kv_blocks`` is set, the pool takes what
    ``gpu_memory_utilization`` of the GPU leaves after the weights and the activations of the largest
    step, measured by running it through ``profile_forward``."""
    if config.kv_cache == "none":
        return None
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    block_size = max_model_len if config.kv_cache == "contiguous" else config.block_size
    shape = (block_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif device.type == "cuda":
        num_blocks = _num_blocks_on_gpu(config, shape, max_model_len, device, profile_forward)
    else:
        num_blocks = num_blocks_for_budget(int(config.cpu_kv_cache_gib * 2**30), *shape)
    if config.kv_cache == "contiguous":
        num_blocks = min(num_blocks, config.max_running)
    tokens = num_blocks * block_size
    logger.info(
        "KV cache (%s): %d blocks of %d tokens = %d tokens, %.2f GiB",
        config.kv_cache, num_blocks, block_size, tokens, tokens * per_token / 2**30,
    )  # fmt: skip
    layers = allocate_kv_pool(
        model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype, device
    )
    return KVCache(BlockManager(num_blocks, block_size), layers, per_token)


@dataclass(frozen=True)
class ProfilePlan:
    """The forward passes whose activations the KV pool must leave room for."""

    step_tokens: int  # the largest step: max_num_batched_tokens, or less if the sequences cannot fill it
    step_seq_len: int  # its sequences' length (the longest allowed: attention's worst case)
    step_sampled: int  # rows sampled with top-k/top-p (the sampler's sort is its largest buffer)
    graph_batch: int  # the largest decode batch captured in CUDA graphs (their own pool); 0: no graphs
    # Rows of the largest graph that computes logits (cuda_graph_logits), profiled with the sampler's
    # buffers too (more than the graphs' argmax needs).
    graph_sampled: int

    @classmethod
    def for_config(cls, config: EngineConfig, max_model_len: int, device: torch.device) -> "ProfilePlan":
        step_tokens = min(config.max_num_batched_tokens, config.max_running * max_model_len)
        sizes = cuda_graph_sizes(config, device)
        return cls(
            step_tokens=step_tokens,
            step_seq_len=min(max_model_len, step_tokens),
            step_sampled=min(config.max_running, step_tokens),
            graph_batch=max(sizes, default=0),
            graph_sampled=min(max(sizes, default=0), GRAPH_LOGITS_MAX_ROWS)
            if config.cuda_graph_logits
            else 0,
        )


def _num_blocks_on_gpu(
    config: EngineConfig,
    shape: tuple[int, int, int, int, torch.dtype],
    max_model_len: int,
    device: torch.device,
    profile_forward: ProfileForward | None,
) -> int:
    plan = ProfilePlan.for_config(config, max_model_len, device)
    weights = torch.cuda.memory_allocated(device)
    step_peak = graph_reserve = 0
    if profile_forward is not None:
        if plan.graph_batch:  # first: the step profile below must set the allocator's peak
            graph_reserve = _peak_bytes(
                device, lambda: profile_forward(plan.graph_batch, 1, plan.graph_sampled)
            )
        step_peak = _peak_bytes(
            device, lambda: profile_forward(plan.step_tokens, plan.step_seq_len, plan.step_sampled)
        )
    torch.cuda.empty_cache()  # the profiled activations' memory is free again, and counted in the peak
    memory = read_device_memory(device)
    budget = kv_budget_bytes(memory, config.gpu_memory_utilization, graph_reserve)
    logger.info(
        "KV budget %.2f GiB = min(%.2f x %.2f GiB total - %.2f GiB peak used [%.2f GiB weights, "
        "%.2f GiB activations of a %d-token step], %.2f GiB free) - %.3f GiB for CUDA graphs "
        "(decode batch %d)",
        budget / _GIB, config.gpu_memory_utilization, memory.total_bytes / _GIB,
        memory.peak_used_bytes / _GIB, weights / _GIB, step_peak / _GIB, plan.step_tokens,
        memory.free_bytes / _GIB, graph_reserve / _GIB, plan.graph_batch,
    )  # fmt: skip
    return num_blocks_for_device_memory(
        memory, config.gpu_memory_utilization, *shape, reserve_bytes=graph_reserve
    )


def _peak_bytes(device: torch.device, run: Callable[[], None]) -> int:
    """Peak memory allocated while ``run`` ran, above what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
