"""A sampling step's inputs: the rows' params and token ids, turned on the host into device tensors.

``SamplingBatch.build`` packs every per-row scalar into one host buffer and copies it in one
asynchronous transfer; sparse (row, token id) pairs (logit bias, bans, allowed tokens, penalised tokens)
take one each.
Only what the rows ask for is built: greedy rows alone need nothing.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch

from tokenmill.sampling_params import SamplingParams

# A top-p threshold that an exclusive cumulative sum (<= 1 plus rounding) never reaches: "disabled".
_TOP_P_DISABLED = 2.0
# Philox keys of unseeded rows, drawn on the host: any non-negative int64.
_MAX_NOISE_SEED = (1 << 63) - 1

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
    allowed: TokenIndex | None  # allowed_token_ids of the rows that restrict theirs (the others: all)
    seen_tokens: TokenIndex | None  # prompt + output ids of rows with a repetition penalty
    output_tokens: TokenIndex | None  # output ids (with repeats) of rows with presence/frequency penalties
    num_logprobs: list[int | None]
    max_top_k: int  # largest enabled top_k, 0 if none
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # Structured outputs: [B, ceil(V / 32)] int32 on the device, bit t of a row set where token t may come
    # next (rows without a grammar: all set); None when no row has a grammar.
    token_bitmask: torch.Tensor | None = None

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
        edits = (self.logit_bias, self.banned, self.allowed, self.seen_tokens, self.output_tokens)
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
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str = "cpu",
        token_bitmask: torch.Tensor | None = None,
    ) -> "SamplingBatch":
        """Host work is O(B + ids of penalised rows), and no device value is read back. Pass the
        logits' device, and the rows' grammar bitmask if some row has a grammar."""
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
            allowed=_allowed_index(params, vocab_size, device),
            seen_tokens=_seen_tokens_index(rows, device) if any_penalty else None,
            output_tokens=_output_tokens_index(rows, device) if any_penalty else None,
            num_logprobs=[p.logprobs for p in params],
            max_top_k=table.max_top_k if table else 0,
            any_greedy=any(table.greedy) if table else True,
            any_top_k=table.any_top_k if table else False,
            any_top_p=table.any_top_p if table else False,
            any_min_p=table.any_min_p if table else False,
            token_bitmask=token_bitmask,
        )


def takes_raw_argmax(params: SamplingParams) -> bool:
    """Whether a row of ``params`` samples the argmax of its unedited logits (greedy, no penalty, no logit
    bias, no allowed ids or bad words), where it has no banned ids and no grammar: a batch of such rows
    builds no tensor."""
    edited = params.logit_bias or params.allowed_token_ids is not None or params.bad_words
    return params.is_greedy and not _has_penalty(params) and not edited


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


def _allowed_index(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> TokenIndex | None:
    if all(p.allowed_token_ids is None for p in params):
        return None
    allowed = [_as_id_array(p.allowed_token_ids or []) for p in params]
    for ids in allowed:  # vectorised: the lists can be long, and are checked every step
        outside = ids[(ids < 0) | (ids >= vocab_size)]
        _check_ids_in_vocab("allowed_token_ids", outside[:1].tolist(), vocab_size)
    return TokenIndex.build([[ids] for ids in allowed], device)


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
