"""What the engine changes when it runs tensor-parallel: workers to start, a per-rank KV pool, eager steps."""

import torch

from tokenmill.config import EngineConfig
from tokenmill.parallel.launcher import WorkerGroup
from tokenmill.parallel.worker import per_rank_model_config

__all__ = ["eager_for_tensor_parallel", "per_rank_model_config", "start_workers"]


def start_workers(config: EngineConfig, device: torch.device, preloaded: bool) -> WorkerGroup | None:
    """The worker processes of ``config.tensor_parallel_size`` > 1 (None for 1: today's path, no group)."""
    if config.tensor_parallel_size == 1:
        return None
    if preloaded:
        raise ValueError(
            "tensor_parallel_size > 1 loads each rank's shard of the model (and the draft model, whole on "
            "rank 0) itself: pass them by name (model, speculative_model), not already loaded"
        )
    if device.type == "cuda" and config.kv.num_blocks is None:
        raise ValueError(
            "tensor_parallel_size > 1 on CUDA needs num_kv_blocks for now (the KV pool's memory profile "
            "runs a forward pass on rank 0 alone)"
        )
    return WorkerGroup(config, device)


def eager_for_tensor_parallel(config: EngineConfig, device: torch.device) -> EngineConfig:
    """Steps run eagerly under tensor parallelism for now: no CUDA graphs, so nothing overlaps."""
    if device.type != "cuda":
        return config
    return config.with_options(cuda_graphs=False, cuda_graph_prefill=False, overlap_decode=False)
