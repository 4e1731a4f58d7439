"""Top-k, top-p and min-p on ``[B, V]`` logits (``apply_top_k_top_p_min_p``), and the same thresholds as
one floor per row for the fused draw (``scaled_logit_floor``)."""

import math

import torch

from tokenmill.runner.sampler.batch import DrawParams, SamplingBatch

# Top-k of few rows runs in two rounds over about this many row slices, each at least this many times k.
_TOP_K_MIN_SLICES = 256
_TOP_K_MIN_CHUNK_PER_K = 4
# Top-p on the CPU looks for its cut among this many of a row's largest logits, then among this many
# more where the cut lies deeper (a hot temperature), and only then sorts the row.
_TOP_P_CANDIDATES = (1024, 16384)


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set to -inf what top-k, then top-p, then min-p remove.

    Top-k keeps the tokens whose logit is at least the k-th largest (ties at the boundary included); top-p
    the shortest prefix of the sorted row whose probability reaches p; min-p the tokens with probability
    >= min_p * max, i.e. logit >= max logit + log(min_p). Only top-p needs a sort (one per step); without
    it, top-k needs just a ``topk``. Both paths give the same bits for a row, so a seeded row's samples
    do not depend on which path the rest of the batch selects. On the CPU, where a sort of the vocabulary
    costs more than the forward of a small model, top-p reads the row's largest logits instead
    (:func:`_top_p_from_candidates`).
    """
    if batch.any_top_p and logits.device.type != "cpu":
        return filter_sorted(logits, batch)
    draw = batch.require_draw()
    if batch.any_top_k:
        kth_largest = _kth_largest(top_k_values(logits, batch.max_top_k), batch, draw)
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    if batch.any_top_p:
        logits = _top_p_from_candidates(logits, draw.top_p)
    if batch.any_min_p:
        logits = logits.masked_fill(
            logits < _min_p_threshold(logits.amax(dim=-1, keepdim=True), draw), -math.inf
        )
    return logits


def filter_sorted(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``apply_top_k_top_p_min_p`` through one sort of the rows: the path top-p needs."""
    draw = batch.require_draw()
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if batch.any_top_k:
        kth_largest = _kth_largest(sorted_logits, batch, draw)
        sorted_logits.masked_fill_(sorted_logits < kth_largest, -math.inf)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    # the largest token always stays, however small p is (a p that rounds to 0 in float32)
    sorted_logits[:, 1:].masked_fill_(mass_before[:, 1:] >= draw.top_p.unsqueeze(1), -math.inf)
    if batch.any_min_p:
        threshold = _min_p_threshold(sorted_logits[:, :1], draw)
        sorted_logits.masked_fill_(sorted_logits < threshold, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_p_from_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p as :func:`filter_sorted` applies it (the shortest prefix of the row in descending order,
    ties in id order, whose probability reaches p), found among each row's largest logits
    (``_TOP_P_CANDIDATES``); only rows whose cut lies past those are sorted whole. A host sync: CPU only."""
    # As softmax: exp(x - max) / sum. exp(x - logsumexp) would lose ulp(x) of each probability to the
    # subtraction, 1e-4 of the mass at logits near 1,000 (a cold temperature), enough to move the cut.
    row_max = logits.amax(dim=-1, keepdim=True)
    normalizer = (row_max, (logits - row_max).exp_().sum(dim=-1, keepdim=True).reciprocal_())
    enabled = (top_p <= 1.0).unsqueeze(1)
    vocab = logits.shape[1]
    width = min(_TOP_P_CANDIDATES[0], vocab)
    kept, last_kept = _top_p_cut(logits.topk(width, dim=-1).values, normalizer, top_p)
    for wider in [*(w for w in _TOP_P_CANDIDATES[1:] if w < vocab), vocab]:
        deeper = ((kept == width) & enabled).squeeze(1).nonzero().squeeze(1)
        if width == vocab or len(deeper) == 0:
            break
        rows = logits[deeper]
        largest = rows.sort(dim=-1, descending=True).values if wider == vocab else rows.topk(wider).values
        row_normalizer = (normalizer[0][deeper], normalizer[1][deeper])
        kept[deeper], last_kept[deeper] = _top_p_cut(largest, row_normalizer, top_p[deeper])
        width = wider
    keep = logits > last_kept
    tied = logits == last_kept
    tied_kept = kept - keep.sum(dim=-1, keepdim=True)  # of the tokens tied with the last one kept
    if bool((tied.sum(dim=-1, keepdim=True) > tied_kept).any()):  # keep the lowest ids, as a stable sort
        tied &= tied.cumsum(dim=-1) <= tied_kept
    return logits.masked_fill(~((keep | tied) | ~enabled), -math.inf)


def _top_p_cut(
    descending: torch.Tensor, normalizer: tuple[torch.Tensor, torch.Tensor], top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, 1]`` each: how many of a row's ``descending`` logits top-p keeps, and the last kept one.
    ``normalizer``: each row's largest logit and 1 / sum(exp(logit - largest)), ``[B, 1]`` each."""
    row_max, inverse_sum = normalizer
    probs = (descending - row_max).exp_().mul_(inverse_sum)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_min_(1)  # the largest stays
    return kept, descending.gather(1, kept - 1)


def scaled_logit_floor(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """``[B]``: the smallest temperature-scaled logit that top-k and min-p keep (-inf where neither is on).

    Dividing by a positive temperature keeps the order, so the k-th largest scaled logit is the k-th
    largest logit, scaled; min-p keeps ``scaled >= max(scaled) + log(min_p)``."""
    return logit_floors(logits, batch, draw)[1]


def logit_floors(
    logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B]`` each: top-k's floor alone (what top-p's probabilities are taken over) and the floor of
    top-k and min-p together, as :func:`scaled_logit_floor`; -inf where off."""
    top_k_floor = torch.full_like(draw.temperature, -math.inf)
    if batch.any_top_k:
        kth_largest = _kth_largest(top_k_values(logits, batch.max_top_k), batch, draw).squeeze(1)
        top_k_floor = kth_largest / draw.temperature
    if not batch.any_min_p:
        return top_k_floor, top_k_floor
    min_p_floor = logits.amax(dim=-1) / draw.temperature + draw.log_min_p
    return top_k_floor, torch.maximum(top_k_floor, min_p_floor)


def top_k_values(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits.topk(k).values`` (``[B, k]``, descending), in two rounds when there are few rows: the k
    largest of each of several column chunks, then the k largest of those. The same values exactly
    (every one of a row's k largest is among its chunk's k largest); one ``topk`` works a row in one
    thread block, so a lone long row would otherwise keep the GPU idle."""
    rows, vocab = logits.shape
    chunks = min(-(-_TOP_K_MIN_SLICES // max(rows, 1)), vocab // (_TOP_K_MIN_CHUNK_PER_K * k))
    if chunks <= 1:
        return logits.topk(k, dim=-1).values
    width = vocab // chunks
    head = logits[:, : chunks * width].reshape(rows, chunks, width).topk(k, dim=-1).values
    candidates = head.reshape(rows, chunks * k)
    if chunks * width < vocab:
        candidates = torch.cat([candidates, logits[:, chunks * width :]], dim=1)
    return candidates.topk(k, dim=-1).values


def _kth_largest(descending: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """``[B, 1]`` k-th largest logit from rows sorted in descending order (at least max_top_k wide);
    -inf on rows without top-k."""
    enabled = draw.top_k < batch.vocab_size
    position = torch.where(enabled, draw.top_k, 1) - 1
    kth = descending.gather(1, position.unsqueeze(1))
    return kth.masked_fill_(~enabled.unsqueeze(1), -math.inf)


def _min_p_threshold(max_logit: torch.Tensor, draw: DrawParams) -> torch.Tensor:
    return max_logit + draw.log_min_p.unsqueeze(1)
