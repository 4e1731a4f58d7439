"""How much GPU memory the KV pool may take: run the largest step the engine will ever run (and the
largest decode graph) without a KV cache, read the allocator's peak, and leave that much for activations.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context
from tokenmill.cache.kv_pool import kv_budget_bytes, num_blocks_for_device_memory, read_device_memory
from tokenmill.config import EngineConfig
from tokenmill.models import CausalLM
from tokenmill.runner.cuda_graphs import GRAPH_LOGITS_MAX_ROWS, cuda_graph_sizes
from tokenmill.runner.sampler import Sampler, SamplingBatch, SamplingRow
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_GIB = 2**30
# What the memory profile samples with: top-k and top-p take the sampler's largest buffers (a sort).
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
# Runs a forward pass of (tokens, longest sequence) without a KV cache and samples (rows) of it.
ProfileForward = Callable[[int, int, int], None]


@torch.inference_mode()
def profile_forward(
    model: CausalLM,
    backend: AttentionBackend,
    sampler: Sampler | None,
    num_tokens: int,
    max_seq_len: int,
    num_sampled: int,
) -> None:
    """Run ``num_tokens`` tokens as sequences of up to ``max_seq_len`` with no KV cache, then sample the
    last ``num_sampled`` rows with top-k and top-p: the activations of the largest step. A tensor-parallel
    worker passes no ``sampler``: it computes its share of the logits, which rank 0 samples."""
    device = next(model.parameters()).device
    lens = [min(max_seq_len, num_tokens - start) for start in range(0, num_tokens, max_seq_len)]
    metadata = AttentionMetadata.for_prefill(lens, device)
    input_ids = torch.arange(num_tokens, device=device) % model.config.vocab_size
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    with forward_context(ForwardContext(metadata, backend, None)):
        hidden = model(input_ids, positions)
    if num_sampled:
        logits = model.compute_logits(hidden[-num_sampled:])
        if sampler is not None:
            rows = [SamplingRow(PROFILE_SAMPLING)] * num_sampled
            sampler(logits, SamplingBatch.build(rows, model.config.vocab_size, device))


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
        scheduler = config.scheduler
        step_tokens = min(scheduler.token_budget, scheduler.max_running * max_model_len)
        sizes = cuda_graph_sizes(config, device)
        return cls(
            step_tokens=step_tokens,
            step_seq_len=min(max_model_len, step_tokens),
            step_sampled=min(scheduler.max_running, step_tokens),
            graph_batch=max(sizes, default=0),
            graph_sampled=min(max(sizes, default=0), GRAPH_LOGITS_MAX_ROWS) if config.graphs.logits else 0,
        )


def num_blocks_on_gpu(
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
    budget = kv_budget_bytes(memory, config.kv.gpu_memory_utilization, graph_reserve)
    logger.info(
        "KV budget %.2f GiB = min(%.2f x %s, %.2f GiB free + %.2f GiB held) - %.2f GiB peak used "
        "[%.2f GiB weights, %.2f GiB activations of a %d-token step] - %.3f GiB for CUDA graphs "
        "(decode batch %d)",
        budget / _GIB, config.kv.gpu_memory_utilization, memory.describe(), memory.free_bytes / _GIB,
        memory.reserved_bytes / _GIB, memory.peak_used_bytes / _GIB, weights / _GIB, step_peak / _GIB,
        plan.step_tokens, graph_reserve / _GIB, plan.graph_batch,
    )  # fmt: skip
    return num_blocks_for_device_memory(
        memory, config.kv.gpu_memory_utilization, *shape, reserve_bytes=graph_reserve
    )


def _peak_bytes(device: torch.device, run: Callable[[], None]) -> int:
    """Peak memory allocated while ``run`` ran, above what was allocated before it."""
    torch.cuda.synchronize(device)
    # Blocks cached but free (an engine this process dropped, say) would count in the reserved peak that
    # read_device_memory takes as this process's use: hand them back before the peak is reset.
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
