"""Batched, on-device sampling: logit edits, penalties, temperature, top-k / top-p / min-p, logprobs.

A ``SamplingBatch`` is built once per step on the host from the B rows' params and token ids; every
tensor it holds is copied to the logits' device in a handful of asynchronous transfers, and only what
the rows ask for is built (greedy rows alone need nothing). ``Sampler`` then works on ``[B, V]`` tensors
only, with shapes fixed by the host-side params: nothing on the path from logits to token ids reads a
device value back to the host; the caller's read of the token ids is the step's one sync.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch

from tokenmill.outputs import RowLogprobs
from tokenmill.sampling_params import SamplingParams

# Exponential noise of exactly 0 would make ``probs / noise`` inf or NaN; clamping changes nothing else.
_MIN_NOISE = 1e-20
# A top-p threshold that an exclusive cumulative sum (<= 1 plus rounding) never reaches: "disabled".
_TOP_P_DISABLED = 2.0
# Philox keys of unseeded rows, drawn on the host: any non-negative int64.
_MAX_NOISE_SEED = (1 << 63) - 1
_PROMPT_LOGPROBS_CHUNK = 1024
# Top-k of few rows runs in two rounds over about this many row slices, each at least this many times k.
_TOP_K_MIN_SLICES = 256
_TOP_K_MIN_CHUNK_PER_K = 4

# Host-side token ids. Numpy arrays / CPU tensors are flattened without a Python loop over their elements,
# so callers that keep prompt ids as arrays pay little for repetition penalties.
TokenIds: TypeAlias = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class SamplingRow:
    """One request's input to a sampling step. ``banned_token_ids`` are masked out at this step only
    (the engine passes EOS / stop ids while fewer than ``min_tokens`` outputs exist)."""

    params: SamplingParams
    prompt_token_ids: TokenIds = ()
    output_token_ids: TokenIds = ()  # its length is the request's step count, which seeds its generator
    banned_token_ids: Sequence[int] = ()


def seed_for_step(seed: int, step: int) -> int:
    """Mix a request seed with its step count (splitmix64) into a generator seed for that step, so a
    seeded row's noise depends on nothing but (seed, step)."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy without blocking the host: from pinned memory, asynchronously, when the target is a GPU."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _as_id_array(ids: TokenIds) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        return ids.detach().cpu().reshape(-1).numpy().astype(np.int64, copy=False)
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def _flatten(per_row_groups: Sequence[Sequence[TokenIds]]) -> np.ndarray:
    """``[2, N]`` int64 array: the row index and the token id of every id of every group of every row."""
    arrays = [[_as_id_array(group) for group in groups] for groups in per_row_groups]
    lengths = [sum(array.size for array in row) for row in arrays]
    flat = np.empty((2, sum(lengths)), dtype=np.int64)
    flat[0] = np.repeat(np.arange(len(arrays), dtype=np.int64), lengths)
    parts = [array for row in arrays for array in row]
    if parts:
        np.concatenate(parts, out=flat[1])
    return flat


def _check_ids_in_vocab(name: str, ids: Sequence[int], vocab_size: int) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{name} holds token id {token_id}, outside the vocabulary [0, {vocab_size})")


@dataclass
class TokenIndex:
    """Sparse (row, token id) pairs on the device, with an optional value per pair."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    values: torch.Tensor | None = None

    @classmethod
    def build(
        cls, per_row_groups: Sequence[Sequence[TokenIds]], device: torch.device, values: Sequence[float] = ()
    ) -> "TokenIndex":
        """``per_row_groups[i]`` lists row i's id groups (e.g. its prompt and output ids); ``values`` are
        aligned with the flattened ids."""
        index = _to_device(torch.from_numpy(_flatten(per_row_groups)), device)
        value_tensor = _to_device(torch.tensor(values, dtype=torch.float32), device) if values else None
        return cls(index[0], index[1], value_tensor)


@dataclass
class DrawParams:
    """Per-row parameters of the draw, on the device. A batch of greedy rows only has none: its draw is
    a plain argmax."""

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor  # [B] float32, _TOP_P_DISABLED where disabled
    log_min_p: torch.Tensor  # [B] float32, -inf where disabled
    # [B] int64 Philox keys of the fused draw: seed_for_step(seed, step) on seeded rows, else fresh
    # randoms from torch's host generator (so torch.manual_seed reproduces an unseeded run).
    noise_seeds: torch.Tensor
    seeded_rows: list[tuple[int, int]]  # (row, seed_for_step) of seeded sampled rows


@dataclass
class PenaltyParams:
    """Per-row penalties, on the device; present when some row has one."""

    repetition: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32


class _RowTable:
    """Every row's scalar params, column by column. Filters of greedy rows are disabled: they would be
    computed for nothing."""

    def __init__(self, params: Sequence[SamplingParams], vocab_size: int) -> None:
        self.greedy = [p.is_greedy for p in params]
        rows = list(zip(params, self.greedy, strict=True))
        self.temperature = [1.0 if g else p.temperature for p, g in rows]
        self.top_p = [_TOP_P_DISABLED if g or p.top_p >= 1.0 else p.top_p for p, g in rows]
        self.log_min_p = [-math.inf if g or p.min_p <= 0 else math.log(p.min_p) for p, g in rows]
        self.top_k = [vocab_size if g or not 0 < p.top_k < vocab_size else p.top_k for p, g in rows]
        self.penalties = [
            [p.repetition_penalty for p in params],
            [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params],
        ]
        self.max_top_k = max((k for k in self.top_k if k < vocab_size), default=0)
        self.any_top_k = self.max_top_k > 0
        self.any_top_p = any(p < 1.0 for p in self.top_p)
        self.any_min_p = any(p > -math.inf for p in self.log_min_p)


def _device_row_params(
    table: _RowTable, seeded_rows: Sequence[tuple[int, int]], device: torch.device
) -> tuple[DrawParams, PenaltyParams]:
    """The per-row tensors, packed into one host buffer and copied to the device in one transfer."""
    num_rows = len(table.greedy)
    noise_seeds = torch.randint(0, _MAX_NOISE_SEED, (num_rows,), dtype=torch.int64).numpy()
    for row, key in seeded_rows:
        noise_seeds[row] = key
    ints = np.array([table.top_k, noise_seeds], dtype=np.int64)
    floats = np.array([table.temperature, table.top_p, table.log_min_p, *table.penalties], dtype=np.float32)
    host = _pack([ints, floats, np.array(table.greedy, dtype=np.uint8)])
    packed = _to_device(torch.from_numpy(host), device)
    ints_dev = packed[: ints.nbytes].view(torch.int64).view(2, num_rows)
    floats_dev = packed[ints.nbytes : ints.nbytes + floats.nbytes].view(torch.float32).view(6, num_rows)
    greedy_dev = packed[ints.nbytes + floats.nbytes :].view(torch.bool)
    draw = DrawParams(
        floats_dev[0], greedy_dev, ints_dev[0], floats_dev[1], floats_dev[2], ints_dev[1], list(seeded_rows)
    )
    return draw, PenaltyParams(floats_dev[3], floats_dev[4], floats_dev[5])


def _pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays' bytes back to back (each a multiple of 4 bytes but the last, int64s first)."""
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in arrays])


@dataclass
class SamplingBatch:
    """Device tensors and host flags for one sampling step over B rows.

    Only what the rows ask for is built and copied: a batch of greedy rows with no penalties, bias or
    bans holds no device tensor at all, and the sampler takes its argmax.
    """

    vocab_size: int
    draw: DrawParams | None  # None when every row is greedy
    penalties: PenaltyParams | None  # None when no row has a repetition / presence / frequency penalty
    logit_bias: TokenIndex | None
    banned: TokenIndex | None
    seen_tokens: TokenIndex | None  # prompt + output ids of rows with a repetition penalty
    output_tokens: TokenIndex | None  # output ids (with repeats) of rows with presence/frequency penalties
    num_logprobs: list[int | None]
    max_top_k: int  # largest enabled top_k, 0 if none
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @property
    def batch_size(self) -> int:
        return len(self.num_logprobs)

    @property
    def all_greedy(self) -> bool:
        return self.draw is None

    @property
    def max_num_logprobs(self) -> int | None:
        requested = [n for n in self.num_logprobs if n is not None]
        return max(requested) if requested else None

    @property
    def needs_logit_edits(self) -> bool:
        edits = (self.logit_bias, self.banned, self.seen_tokens, self.output_tokens)
        return any(edit is not None for edit in edits)

    @property
    def needs_filtering(self) -> bool:
        return self.any_top_k or self.any_top_p or self.any_min_p

    def require_draw(self) -> DrawParams:
        if self.draw is None:
            raise ValueError("this batch has only greedy rows: there is nothing to draw")
        return self.draw

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str = "cpu"
    ) -> "SamplingBatch":
        """Host work is O(B + ids of penalised rows), and no device value is read back. Pass the
        logits' device."""
        device = torch.device(device)
        params = [row.params for row in rows]
        any_sampled = not all(p.is_greedy for p in params)
        any_penalty = any(map(_has_penalty, params))
        draw = penalties = table = None
        if any_sampled or any_penalty:
            table = _RowTable(params, vocab_size)
            draw, penalties = _device_row_params(table, _seeded_rows(rows, table.greedy), device)
        return cls(
            vocab_size=vocab_size,
            draw=draw if any_sampled else None,
            penalties=penalties if any_penalty else None,
            logit_bias=_logit_bias_index(params, vocab_size, device),
            banned=_banned_index(rows, vocab_size, device),
            seen_tokens=_seen_tokens_index(rows, device) if any_penalty else None,
            output_tokens=_output_tokens_index(rows, device) if any_penalty else None,
            num_logprobs=[p.logprobs for p in params],
            max_top_k=table.max_top_k if table else 0,
            any_greedy=any(table.greedy) if table else True,
            any_top_k=table.any_top_k if table else False,
            any_top_p=table.any_top_p if table else False,
            any_min_p=table.any_min_p if table else False,
        )


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )


def _logit_bias_index(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> TokenIndex | None:
    biases = [p.logit_bias or {} for p in params]
    if not any(biases):
        return None
    for bias in biases:
        _check_ids_in_vocab("logit_bias", list(bias), vocab_size)
    values = [value for bias in biases for value in bias.values()]
    return TokenIndex.build([[list(bias)] for bias in biases], device, values)


def _banned_index(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> TokenIndex | None:
    if not any(row.banned_token_ids for row in rows):
        return None
    for row in rows:
        _check_ids_in_vocab("banned_token_ids", row.banned_token_ids, vocab_size)
    return TokenIndex.build([[row.banned_token_ids] for row in rows], device)


def _seen_tokens_index(rows: Sequence[SamplingRow], device: torch.device) -> TokenIndex | None:
    penalised = [row.params.repetition_penalty != 1.0 for row in rows]
    if not any(penalised):
        return None
    groups = [
        [row.prompt_token_ids, row.output_token_ids] if on else []
        for row, on in zip(rows, penalised, strict=True)
    ]
    return TokenIndex.build(groups, device)


def _output_tokens_index(rows: Sequence[SamplingRow], device: torch.device) -> TokenIndex | None:
    penalised = [row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0 for row in rows]
    if not any(penalised):
        return None
    groups = [[row.output_token_ids] if on else [] for row, on in zip(rows, penalised, strict=True)]
    return TokenIndex.build(groups, device)


def _seeded_rows(rows: Sequence[SamplingRow], greedy: Sequence[bool]) -> list[tuple[int, int]]:
    """(row, key) of each seeded sampled row, the key ``seed_for_step(seed, len(output_token_ids))``."""
    return [
        (index, seed_for_step(row.params.seed, len(row.output_token_ids)))
        for index, row in enumerate(rows)
        if row.params.seed is not None and not greedy[index]
    ]


@dataclass
class LogprobsTensors:
    """Logprobs of chosen tokens ([N]) and the top-K alternatives ([N, K]) for N rows / positions."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @classmethod
    def cat(cls, parts: Sequence["LogprobsTensors"]) -> "LogprobsTensors":
        return cls(
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.logprobs for p in parts]),
            torch.cat([p.ranks for p in parts]),
            torch.cat([p.top_ids for p in parts]),
            torch.cat([p.top_logprobs for p in parts]),
        )

    def to_rows(self, num_top: Sequence[int | None] | int) -> list[RowLogprobs]:
        """Python values per row (one device-to-host copy per tensor); row i keeps its first ``num_top[i]``
        alternatives."""
        counts = [num_top] * len(self.token_ids) if isinstance(num_top, int) else list(num_top)
        token_ids, logprobs, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [
            RowLogprobs(
                token_ids[i],
                logprobs[i],
                ranks[i],
                list(zip(top_ids[i][:k], top_logprobs[i][:k], strict=True)),
            )
            for i, k in enumerate(count or 0 for count in counts)
        ]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Logprob and rank of ``token_ids[i]`` in row i of ``logprobs`` ``[N, V]``, and the top ``num_top``."""
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=1)
    return LogprobsTensors(token_ids.long(), chosen, ranks, top_ids, top_logprobs)


def compute_prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: torch.Tensor | Sequence[int], num_top: int
) -> LogprobsTensors:
    """Logprobs of each prompt token after the first, given the raw logits at the prompt positions.

    ``logits[i]`` (float, ``[L, V]`` or ``[L - 1, V]``) predicts ``prompt_token_ids[i + 1]``; the result has
    L - 1 rows (the first prompt token has no logprob). Computed in chunks of rows to bound memory.
    """
    targets = torch.as_tensor(prompt_token_ids, dtype=torch.long, device=logits.device)[1:]
    logits = logits[: targets.shape[0]]
    chunks = [
        gather_logprobs(
            torch.log_softmax(logits[start : start + _PROMPT_LOGPROBS_CHUNK].float(), dim=-1),
            targets[start : start + _PROMPT_LOGPROBS_CHUNK],
            num_top,
        )
        for start in range(0, targets.shape[0], _PROMPT_LOGPROBS_CHUNK)
    ]
    if not chunks:
        return gather_logprobs(torch.empty(0, logits.shape[-1], device=logits.device), targets, num_top)
    return LogprobsTensors.cat(chunks)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # Present when some row asked for logprobs; ``top_*`` are as wide as the largest request in the batch.
    logprobs: LogprobsTensors | None = None


class Sampler:
    """Turns a step's ``[B, V]`` logits into token ids, all rows at once, with no host-device sync.

    Order: logit bias and banned tokens, repetition penalty (HF: over prompt and output tokens, positive
    logits divided by it, negative ones multiplied), presence / frequency penalties (OpenAI: over output
    tokens), argmax for greedy rows; for the others temperature, top-k, top-p, min-p, then a sample drawn
    as ``argmax(probs / Exp(1) noise)``, which is exact and needs no ``torch.multinomial`` sync. A batch
    of greedy rows only is one ``argmax`` (plus the edits its rows ask for).

    ``use_triton`` (``EngineConfig.fused_sampling``) draws with ``tokenmill.kernels.sampling`` instead:
    temperature, the top-k / min-p floor and the Gumbel-max draw in one pass over the logits, the same
    distribution with in-kernel noise (top-p still sorts in PyTorch first). Seeded rows stay independent
    of the batch on either path, but the two paths draw different samples from the same seed.

    Logprobs are those of the model's raw logits (``log_softmax`` before bias, penalties, temperature and
    filtering), as vLLM v1 returns by default.
    """

    def __init__(self, use_triton: bool = False) -> None:
        self.use_triton = use_triton

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, argmax: torch.Tensor | None = None
    ) -> SamplerOutput:
        """``argmax``: ``logits.argmax(dim=-1)`` when already computed (decode graphs compute it with the
        logits); a batch of greedy rows without logit edits takes its tokens from it as they are."""
        logits = logits.float()
        processed = apply_penalties(logits, batch)
        if batch.draw is None and argmax is not None and not batch.needs_logit_edits:
            token_ids = argmax
        elif batch.draw is None:
            token_ids = self.argmax(processed)
        elif self.use_triton:
            token_ids = _draw_fused(processed, batch, batch.draw)
        else:
            token_ids = _draw(processed, batch, batch.draw)
        num_top = batch.max_num_logprobs
        if num_top is None:
            return SamplerOutput(token_ids)
        return SamplerOutput(
            token_ids, gather_logprobs(torch.log_softmax(logits, dim=-1), token_ids, num_top)
        )

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(dim=-1)`` of float32 ``[B, V]`` logits (ties to the lowest id)."""
        if self.use_triton:
            from tokenmill.kernels.sampling import argmax

            return argmax(logits)
        return logits.argmax(dim=-1)


def _draw(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """The PyTorch draw: filtered softmax over Exp(1) noise, argmax; greedy rows take the plain argmax."""
    scaled = logits / draw.temperature.unsqueeze(1)
    if batch.needs_filtering:
        scaled = apply_top_k_top_p_min_p(scaled, batch)
    probs = torch.softmax(scaled, dim=-1)
    token_ids = probs.div_(_exponential_noise(probs, draw)).argmax(dim=-1)
    if batch.any_greedy:
        token_ids = torch.where(draw.greedy, logits.argmax(dim=-1), token_ids)
    return token_ids


def _draw_fused(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """The Triton draw. Without top-p, the kernel scales and filters the raw logits itself, given each
    row's floor ``max(k-th largest, max + T log min_p) / T`` (the PyTorch filters' thresholds, rounded
    alike); with top-p, the sorted PyTorch filter runs first and the kernel only draws."""
    from tokenmill.kernels.sampling import gumbel_max_sample

    if batch.any_top_p:
        filtered = _filter_sorted(logits / draw.temperature.unsqueeze(1), batch)
        return gumbel_max_sample(filtered, draw.greedy, draw.noise_seeds)
    floor = _scaled_logit_floor(logits, batch, draw) if batch.needs_filtering else None
    return gumbel_max_sample(logits, draw.greedy, draw.noise_seeds, draw.temperature, floor)


def _scaled_logit_floor(logits: torch.Tensor, batch: SamplingBatch, draw: DrawParams) -> torch.Tensor:
    """``[B]``: the smallest temperature-scaled logit that top-k and min-p keep (-inf where neither is on).

    Dividing by a positive temperature keeps the order, so the k-th largest scaled logit is the k-th
    largest logit, scaled; min-p keeps ``scaled >= max(scaled) + log(min_p)``."""
    temperature = draw.temperature
    floor = torch.full_like(temperature, -math.inf)
    if batch.any_top_k:
        kth_largest = _kth_largest(top_k_values(logits, batch.max_top_k), batch, draw).squeeze(1)
        floor = kth_largest / temperature
    if batch.any_min_p:
        floor = torch.maximum(floor, logits.amax(dim=-1) / temperature + draw.log_min_p)
    return floor


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logit bias, bans, repetition / presence / frequency penalties; a new tensor when anything applies."""
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
    if batch.seen_tokens is not None or batch.output_tokens is not None:
        logits = _apply_penalty_params(logits, batch)
    return logits


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


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set to -inf what top-k, then top-p, then min-p remove.

    Top-k keeps the tokens whose logit is at least the k-th largest (ties at the boundary included); top-p
    the shortest prefix of the sorted row whose probability reaches p; min-p the tokens with probability
    >= min_p * max, i.e. logit >= max logit + log(min_p). Only top-p needs a sort (one per step); without
    it, top-k needs just a ``topk``. Both paths give the same bits for a row, so a seeded row's samples
    do not depend on which path the rest of the batch selects.
    """
    if batch.any_top_p:
        return _filter_sorted(logits, batch)
    draw = batch.require_draw()
    if batch.any_top_k:
        kth_largest = _kth_largest(top_k_values(logits, batch.max_top_k), batch, draw)
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    if batch.any_min_p:
        logits = logits.masked_fill(
            logits < _min_p_threshold(logits.amax(dim=-1, keepdim=True), draw), -math.inf
        )
    return logits


def _filter_sorted(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    draw = batch.require_draw()
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if batch.any_top_k:
        kth_largest = _kth_largest(sorted_logits, batch, draw)
        sorted_logits.masked_fill_(sorted_logits < kth_largest, -math.inf)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    sorted_logits.masked_fill_(mass_before >= draw.top_p.unsqueeze(1), -math.inf)
    if batch.any_min_p:
        threshold = _min_p_threshold(sorted_logits[:, :1], draw)
        sorted_logits.masked_fill_(sorted_logits < threshold, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


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
