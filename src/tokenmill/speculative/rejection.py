"""The rejection sampler: which draft tokens the model keeps, so that the output is exactly the model's.

Each verified position ``r`` has the model's distribution ``p_r`` (after the same logit edits, temperature
and top-k / top-p / min-p as a plain step) and, where a draft token ``d_r`` was proposed there, the
distribution ``q_r`` it was drawn from (one-hot for n-gram guesses and greedy drafts). Position ``r``
accepts ``d_r`` with probability ``min(1, p_r(d_r) / q_r(d_r))``; the first rejected position emits a
token drawn from ``max(0, p_r - q_r)`` normalised instead, and a sequence whose drafts are all accepted
emits a bonus token drawn from ``p`` at its last position (Leviathan et al. 2023; Chen et al. 2023).
Greedy rows accept a draft token exactly when it is the argmax, and otherwise emit the argmax.

Where every guess is one-hot (n-gram guesses, greedy drafts) the rule needs no noise of its own: each row
draws from ``p_r`` as a plain step would there and keeps its guess when the draw equals it
(:func:`accept_drawn`), which accepts ``d_r`` with probability ``p_r(d_r)`` and otherwise emits a draw
from ``p_r`` without ``d_r``; the draws are the plain steps', so a seeded request's tokens are the same
with speculation on or off.

Everything here works on all rows at once on the device; :func:`accepted_prefixes` reads the result back
in one transfer and walks each sequence's rows on the host.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.runner.sampler import SamplingBatch, apply_penalties, apply_top_k_top_p_min_p
from tokenmill.runner.sampler.inverse_cdf import inverse_cdf_draw, row_uniforms


@dataclass
class Distributions:
    """The model's (or a draft's) distributions over ``N`` rows."""

    processed: torch.Tensor  # [N, V] float32 logits after the logit edits (penalties, bias, bans)
    probs: torch.Tensor | None  # [N, V] after temperature and filtering; None when every row is greedy
    greedy: torch.Tensor | None  # [N] bool; None when every row is greedy


def distributions(logits: torch.Tensor, batch: SamplingBatch) -> Distributions:
    """What a plain step would draw from at each row of ``logits`` (masked by the grammar already)."""
    processed = apply_penalties(logits.float(), batch)
    draw = batch.draw
    if draw is None:
        return Distributions(processed, None, None)
    scaled = processed / draw.temperature.unsqueeze(1)
    if batch.needs_filtering:
        scaled = apply_top_k_top_p_min_p(scaled, batch)
    return Distributions(processed, torch.softmax(scaled, dim=-1), draw.greedy)


def sample_rows(dist: Distributions, noise: "RowNoise") -> torch.Tensor:
    """One token per row drawn from ``dist`` (the argmax on greedy rows)."""
    argmax = dist.processed.argmax(dim=-1)
    if dist.probs is None:
        return argmax
    drawn = inverse_cdf_draw(dist.probs, noise.draws(len(argmax), argmax.device))
    assert dist.greedy is not None
    return torch.where(dist.greedy, argmax, drawn)


class RowNoise:
    """Uniform numbers per row, for draws and for acceptance tests (two streams); seeded rows draw theirs
    from their own generator (keyed by ``(seed, step)``), so a seeded request repeats whatever else is in
    the batch."""

    def __init__(self, seeded_rows: Sequence[tuple[int, int]]) -> None:
        self.seeded_rows = seeded_rows

    def _generators(self, device: torch.device) -> list[tuple[int, torch.Generator]]:
        out = []
        for row, key in self.seeded_rows:
            generator = torch.Generator(device=device)
            generator.manual_seed(key)
            out.append((row, generator))
        return out

    def draws(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """float64 uniforms for inverse-CDF draws (the plain steps' stream)."""
        return row_uniforms(num_rows, self.seeded_rows, device)

    def uniform(self, num_rows: int, device: torch.device) -> torch.Tensor:
        values = torch.rand(num_rows, device=device)
        for row, generator in self._generators(device):
            # a different stream from the draws': offset the key
            generator.manual_seed(generator.initial_seed() ^ 0x5BD1E995)
            values[row] = torch.rand((), generator=generator, device=device)
        return values


def verify(
    target: Distributions,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    noise: RowNoise,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether its draft token is accepted, and the token the row emits (the draft token if
    accepted, else a draw from the residual; rows without a draft, ``draft_ids`` -1, draw from ``p``).
    ``draft_probs``: ``[N, V]`` draft distributions (zero rows where there is no draft), or None where
    every draft is one-hot."""
    if draft_probs is None:
        drawn = sample_rows(target, noise)
        return accept_drawn(drawn, draft_ids), drawn
    has_draft = draft_ids >= 0
    ids = draft_ids.clamp_min(0).unsqueeze(1)
    argmax = target.processed.argmax(dim=-1)
    greedy_accept = has_draft & (draft_ids == argmax)
    if target.probs is None:
        return greedy_accept, torch.where(greedy_accept, draft_ids, argmax)
    probs = target.probs
    p_draft = probs.gather(1, ids).squeeze(1)
    q_draft = draft_probs.gather(1, ids).squeeze(1)
    residual = (probs - draft_probs).clamp_min_(0.0)
    residual = torch.where(has_draft.unsqueeze(1), residual, probs)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q up to rounding: fall back to p
    residual = torch.where(empty, probs, residual)
    uniform = noise.uniform(len(draft_ids), draft_ids.device)
    sampled_accept = has_draft & (uniform * q_draft < p_draft)
    recovered = inverse_cdf_draw(residual, noise.draws(len(draft_ids), draft_ids.device))
    assert target.greedy is not None
    accept = torch.where(target.greedy, greedy_accept, sampled_accept)
    fallback = torch.where(target.greedy, argmax, recovered)
    return accept, torch.where(accept, draft_ids, fallback)


def accept_drawn(drawn: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """One-hot guesses: a row keeps its guess exactly when the model's draw there equals it (the row then
    emits its draw either way; rows without a guess, ``draft_ids`` -1, keep nothing)."""
    return (draft_ids >= 0) & (drawn == draft_ids)


def accepted_prefixes(accept: torch.Tensor, tokens: torch.Tensor, num_rows: Sequence[int]) -> list[list[int]]:
    """Each sequence's emitted tokens, given its ``num_rows[i]`` consecutive rows: its accepted draft
    tokens up to the first rejection, then the token of the row that rejected (or the last row's)."""
    flags, ids = torch.stack([accept.long(), tokens.long()]).tolist()
    emitted = []
    row = 0
    for count in num_rows:
        out = []
        for offset in range(count):
            out.append(ids[row + offset])
            if not flags[row + offset]:
                break
        emitted.append(out)
        row += count
    return emitted
