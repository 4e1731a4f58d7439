"""What the engine changes when it runs tensor-parallel: workers to start and a per-rank KV pool (every rank
profiles its own GPU; the smallest pool wins). Steps run as they do on one rank, CUDA graphs and
overlapped decoding included (each worker follows rank 0's steps)."""

import torch

from tokenmill.config import EngineConfig
from tokenmill.parallel.launcher import WorkerGroup
from tokenmill.parallel.worker import per_rank_model_config

__all__ = ["per_rank_model_config", "start_workers"]


def start_workers(config: EngineConfig, device: torch.device, preloaded: bool) -> WorkerGroup | None:
    """The worker processes of ``config.tensor_parallel_size`` > 1 (None for 1: today's path, no group)."""
    if config.tensor_parallel_size == 1:
        return None
    if preloaded:
        raise ValueError(
            "tensor_parallel_size > 1 loads each rank's shard of the model (and the draft model, whole on "
            "rank 0) itself: pass them by name (model, speculative_model), not already loaded"
        )
    for name in ("custom_all_reduce", "push_all_reduce"):
        if getattr(config, name) and device.type != "cuda":
            raise ValueError(
                f"{name} needs CUDA devices (symmetric memory between GPUs), not {device.type}: "
                "leave it unset or off (the ranks' all-reduces then go through gloo)"
            )
    return WorkerGroup(config, device)
