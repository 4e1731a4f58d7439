"""The fused (Triton) draw: ``tokenmill.kernels.sampling`` scales, filters and draws in one pass.

Importing this module imports triton: ``Sampler(fused=True)`` imports it once, when it binds its draw;
nothing else in the package does, so the sampler imports where triton is not installed.
"""

import torch

from tokenmill.kernels import sampling, top_p_sampling
from tokenmill.kernels.sampling import argmax, gumbel_max_sample
from tokenmill.kernels.token_bitmask import apply_token_bitmask
from tokenmill.kernels.top_p_sampling import top_p_draw
from tokenmill.runner.sampler.batch import DrawParams, SamplingBatch
from tokenmill.runner.sampler.filters import logit_floors, scaled_logit_floor


def fused_draw(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """The Triton draw. The kernel scales and filters the raw logits itself, given each row's floor
    ``max(k-th largest, max + T log min_p) / T`` (the PyTorch filters' thresholds, rounded alike); with
    top-p, a kernel that draws and rejects what lies outside the top-p set (``kernels.top_p_sampling``)."""
    if batch.any_top_p:
        mass_floor, draw_floor = logit_floors(logits, batch, draw)
        return top_p_draw(
            logits, draw.temperature, draw.greedy, draw.noise_seeds, draw.top_p, mass_floor, draw_floor
        )
    floor = scaled_logit_floor(logits, batch, draw) if batch.needs_filtering else None
    return gumbel_max_sample(logits, draw.greedy, draw.noise_seeds, draw.temperature, floor)


def compile_variants(vocab: int, max_rows: int, device: torch.device) -> None:
    """Compile every kernel variant the draw can reach for this vocabulary, so none compiles mid-request."""
    sampling.compile_variants(vocab, max_rows, device)
    top_p_sampling.compile_variants(vocab, device)


__all__ = ["apply_token_bitmask", "argmax", "compile_variants", "fused_draw"]
