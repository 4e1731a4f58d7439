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
from tokenmill.runner.sampler.filters import filter_sorted, logit_floors, scaled_logit_floor

# The top-p kernel gives each row one program: below this many rows it leaves most of the GPU idle and
# sorting the rows costs less (H200, 128,256 tokens: 1 row 275 against 121 us, 64 rows 471 against 1,158).
TOP_P_KERNEL_MIN_ROWS = 16


def fused_draw(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """The Triton draw. The kernel scales and filters the raw logits itself, given each row's floor
    ``max(k-th largest, max + T log min_p) / T`` (the PyTorch filters' thresholds, rounded alike). With
    top-p, a kernel that rejects draws outside the top-p set (``kernels.top_p_sampling``), or for a few
    rows the sorting PyTorch filter, then the draw: the same token either way, from the same noise (up to
    rounding at the top-p cut)."""
    if batch.any_top_p and len(logits) >= TOP_P_KERNEL_MIN_ROWS:
        mass_floor, draw_floor = logit_floors(logits, batch, draw)
        return top_p_draw(
            logits, draw.temperature, draw.greedy, draw.noise_seeds, draw.top_p, mass_floor, draw_floor
        )
    if batch.any_top_p:
        filtered = filter_sorted(logits / draw.temperature.unsqueeze(1), batch)
        return gumbel_max_sample(filtered, draw.greedy, draw.noise_seeds)
    floor = scaled_logit_floor(logits, batch, draw) if batch.needs_filtering else None
    return gumbel_max_sample(logits, draw.greedy, draw.noise_seeds, draw.temperature, floor)


def compile_variants(vocab: int, max_rows: int, device: torch.device) -> None:
    """Compile every kernel variant the draw can reach for this vocabulary, so none compiles mid-request."""
    sampling.compile_variants(vocab, max_rows, device)
    top_p_sampling.compile_variants(vocab, device)


__all__ = ["apply_token_bitmask", "argmax", "compile_variants", "fused_draw"]
