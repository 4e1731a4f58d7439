"""The fused (Triton) draw: ``tokenmill.kernels.sampling`` scales, filters and draws in one pass.

Importing this module imports triton: ``Sampler(fused=True)`` imports it once, when it binds its draw;
nothing else in the package does, so the sampler imports where triton is not installed.
"""

import torch

from tokenmill.kernels.sampling import argmax, compile_variants, gumbel_max_sample
from tokenmill.kernels.token_bitmask import apply_token_bitmask
from tokenmill.runner.sampler.batch import DrawParams, SamplingBatch
from tokenmill.runner.sampler.filters import filter_sorted, scaled_logit_floor


def fused_draw(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """The Triton draw. Without top-p, the kernel scales and filters the raw logits itself, given each
    row's floor ``max(k-th largest, max + T log min_p) / T`` (the PyTorch filters' thresholds, rounded
    alike); with top-p, the sorted PyTorch filter runs first and the kernel only draws."""
    if batch.any_top_p:
        filtered = filter_sorted(logits / draw.temperature.unsqueeze(1), batch)
        return gumbel_max_sample(filtered, draw.greedy, draw.noise_seeds)
    floor = scaled_logit_floor(logits, batch, draw) if batch.needs_filtering else None
    return gumbel_max_sample(logits, draw.greedy, draw.noise_seeds, draw.temperature, floor)


__all__ = ["apply_token_bitmask", "argmax", "compile_variants", "fused_draw"]
