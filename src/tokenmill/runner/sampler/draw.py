"""The PyTorch draw: filtered softmax over Exp(1) noise, argmax.

``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per token is an exact sample from ``probs`` and needs no
``torch.multinomial`` (which reads a device value back). Seeded rows draw their noise from their own
generator, keyed by ``seed_for_step``, so their samples do not depend on the rest of the batch.
"""

from collections.abc import Callable
from typing import TypeAlias

import torch

from tokenmill.runner.sampler.batch import DrawParams, SamplingBatch
from tokenmill.runner.sampler.filters import apply_top_k_top_p_min_p

# Exponential noise of exactly 0 would make ``probs / noise`` inf or NaN; clamping changes nothing else.
_MIN_NOISE = 1e-20

# A draw: penalised float32 ``[B, V]`` logits, their batch and its draw params to ``[B]`` int64 token ids.
DrawFn: TypeAlias = Callable[[torch.Tensor, SamplingBatch, DrawParams], torch.Tensor]
# ``logits.argmax(dim=-1)`` of float32 ``[B, V]`` logits, ties to the lowest id.
ArgmaxFn: TypeAlias = Callable[[torch.Tensor], torch.Tensor]
# Structured outputs: float32 ``[B, V]`` logits and a ``[B, ceil(V/32)]`` int32 bitmask to the logits with
# the tokens whose bit is clear set to -inf (a new tensor).
MaskFn: TypeAlias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def torch_draw(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """The PyTorch draw: filtered softmax over Exp(1) noise, argmax; greedy rows take the plain argmax."""
    scaled = logits / draw.temperature.unsqueeze(1)
    if batch.needs_filtering:
        scaled = apply_top_k_top_p_min_p(scaled, batch)
    probs = torch.softmax(scaled, dim=-1)
    token_ids = probs.div_(_exponential_noise(probs, draw)).argmax(dim=-1)
    if batch.any_greedy:
        token_ids = torch.where(draw.greedy, logits.argmax(dim=-1), token_ids)
    return token_ids


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _exponential_noise(probs: torch.Tensor, draw: DrawParams) -> torch.Tensor:
    """Exp(1) noise per token; seeded rows draw theirs from their own generator, so their samples do not
    depend on the rest of the batch."""
    noise = torch.empty_like(probs)
    if len(draw.seeded_rows) < probs.shape[0]:
        noise.exponential_()
    for row, key in draw.seeded_rows:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(key)
        noise[row].exponential_(generator=generator)
    return noise.clamp_min_(_MIN_NOISE)
