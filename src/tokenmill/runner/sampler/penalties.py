"""Logit edits before the draw: logit bias, banned tokens, allowed tokens, repetition / presence /
frequency penalties.

Repetition penalty as in HF (over prompt and output tokens: positive logits divided by it, negative ones
multiplied); presence and frequency penalties as in OpenAI (over output tokens).
"""

import math

import torch

from tokenmill.runner.sampler.batch import SamplingBatch, TokenIndex


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logit bias, bans, allowed ids, repetition / presence / frequency penalties; a new tensor when anything
    applies."""
    if not batch.needs_logit_edits:
        return logits
    logits = logits.clone()
    if batch.logit_bias is not None:
        bias = batch.logit_bias
        assert bias.values is not None
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if batch.banned is not None:
        logits.index_put_(
            (batch.banned.rows, batch.banned.token_ids), torch.full((), -math.inf, device=logits.device)
        )
    if batch.allowed is not None:
        _keep_only_allowed(logits, batch.allowed)
    if batch.seen_tokens is not None or batch.output_tokens is not None:
        logits = _apply_penalty_params(logits, batch)
    return logits


def _keep_only_allowed(logits: torch.Tensor, allowed: TokenIndex) -> None:
    """-inf on every token outside its row's allowed ids, in the rows that list some (in place)."""
    true = torch.ones((), dtype=torch.bool, device=logits.device)
    restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    restricted.index_put_((allowed.rows,), true)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.index_put_((allowed.rows, allowed.token_ids), true)
    logits.masked_fill_(restricted.unsqueeze(1) & ~keep, -math.inf)


def _apply_penalty_params(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    penalties = batch.penalties
    assert penalties is not None, "token indexes for penalties are built only with the penalties"
    if batch.seen_tokens is not None:
        logits = _apply_repetition_penalty(logits, batch.seen_tokens, penalties.repetition)
    if batch.output_tokens is not None:
        counts = _token_counts(logits, batch.output_tokens)
        logits -= penalties.frequency.unsqueeze(1) * counts
        logits -= penalties.presence.unsqueeze(1) * (counts > 0)
    return logits


def _apply_repetition_penalty(logits: torch.Tensor, seen: TokenIndex, penalty: torch.Tensor) -> torch.Tensor:
    seen_mask = torch.zeros_like(logits, dtype=torch.bool)
    seen_mask.index_put_((seen.rows, seen.token_ids), torch.ones((), dtype=torch.bool, device=logits.device))
    row_penalty = penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / row_penalty, logits * row_penalty)
    return torch.where(seen_mask, penalised, logits)


def _token_counts(logits: torch.Tensor, tokens: TokenIndex) -> torch.Tensor:
    counts = torch.zeros_like(logits)
    ones = torch.ones_like(tokens.rows, dtype=logits.dtype)
    return counts.index_put_((tokens.rows, tokens.token_ids), ones, accumulate=True)
