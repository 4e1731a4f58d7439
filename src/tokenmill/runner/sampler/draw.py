"""The PyTorch draw: filtered softmax, then one uniform number per row through its running sum.

The inverse-CDF draw (:mod:`.inverse_cdf`) is exact and needs no ``torch.multinomial`` (which reads a
device value back). Seeded rows draw their number from their own generator, keyed by ``seed_for_step``,
so their samples do not depend on the rest of the batch.
"""

from collections.abc import Callable
from typing import TypeAlias

import torch

from tokenmill.runner.sampler.batch import DrawParams, SamplingBatch
from tokenmill.runner.sampler.filters import apply_top_k_top_p_min_p
from tokenmill.runner.sampler.inverse_cdf import inverse_cdf_draw, row_uniforms

# A draw: penalised float32 ``[B, V]`` logits, their batch and its draw params to ``[B]`` int64 token ids.
DrawFn: TypeAlias = Callable[[torch.Tensor, SamplingBatch, DrawParams], torch.Tensor]
# ``logits.argmax(dim=-1)`` of float32 ``[B, V]`` logits, ties to the lowest id.
ArgmaxFn: TypeAlias = Callable[[torch.Tensor], torch.Tensor]
# Structured outputs: float32 ``[B, V]`` logits and a ``[B, ceil(V/32)]`` int32 bitmask to the logits with
# the tokens whose bit is clear set to -inf (a new tensor).
MaskFn: TypeAlias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def torch_draw(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """The PyTorch draw: filtered softmax, inverse-CDF draw; greedy rows take the plain argmax."""
    scaled = logits / draw.temperature.unsqueeze(1)
    if batch.needs_filtering:
        scaled = apply_top_k_top_p_min_p(scaled, batch)
    probs = torch.softmax(scaled, dim=-1)
    token_ids = inverse_cdf_draw(probs, row_uniforms(len(probs), draw.seeded_rows, probs.device))
    if batch.any_greedy:
        token_ids = torch.where(draw.greedy, logits.argmax(dim=-1), token_ids)
    return token_ids


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)
