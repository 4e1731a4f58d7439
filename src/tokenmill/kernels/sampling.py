"""One pass over ``[B, V]`` logits that applies temperature and a per-row logit floor and draws a token.

The draw is the Gumbel-max trick: ``argmax(logits / T - log(E))`` with ``E ~ Exp(1)`` i.i.d. per token is a
sample from ``softmax(logits / T)`` restricted to the tokens kept (the same identity as the PyTorch
sampler's ``argmax(probs / E)``, without the softmax and the noise tensor). ``E = -log(U)`` with ``U``
drawn in the kernel by Philox, keyed by the row's seed and counted by the token id, so a row's noise
depends on its seed alone, not on the batch, the grid or the block sizes. ``E`` is computed from the
distance of ``U`` to 1 (``-log1p(-V)``, ``V = 1 - U``), exact where it matters: a small ``E`` is a large
bonus, and float32 rounding of ``U`` to 1 would otherwise hand some token an infinite one. Greedy rows
take the plain argmax (ties to the lowest id, like ``torch.argmax``).

Rows are cut into column ranges, one program per (row group, range), so that one long row still fills
the GPU; a second tiny kernel picks each row's best range. When one range covers the vocabulary the
first kernel writes the token ids itself. The grid depends on B and V only: CUDA-graph capturable.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import cdiv, next_power_of_2, require_unit_last_stride, sm_count

BLOCK_V = 1024  # columns per tile
ELEMENTS_PER_TILE = 1024  # narrow rows are batched several to a program, up to about this many elements
MAX_ROWS_PER_PROGRAM = 64
PROGRAMS_PER_SM = 4
TWO_TO_MINUS_31: tl.constexpr = tl.constexpr(4.656612873077393e-10)
# -log(1 - v) by its series v + v^2/2 + v^3/3 below this (relative error under 1e-12).
LOG1P_SERIES_BELOW: tl.constexpr = tl.constexpr(1e-3)


@triton.jit
def _exponential_noise(bits: tl.tensor) -> tl.tensor:
    """Exp(1) from 32 random bits: ``-log(1 - V)`` for ``V = (x + 1/2) / 2^31`` in (0, 1), x the low 31 bits.

    ``V`` never rounds to 0, so the noise is never 0 (an infinite Gumbel bonus); a ``V`` that rounds to 1
    gives +inf (that token is not drawn, a 3e-8 chance)."""
    x = bits.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, ~x, x)
    v = (x.to(tl.float32) + 0.5) * TWO_TO_MINUS_31
    series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0)))
    return tl.where(v < LOG1P_SERIES_BELOW, series, -tl.log(1.0 - v))


@triton.jit(do_not_specialize=["num_rows", "tiles_per_program", "num_parts"])  # B changes every step
def _gumbel_max_kernel(
    logits_ptr: tl.tensor,
    temperature_ptr: tl.tensor,
    greedy_ptr: tl.tensor,
    seeds_ptr: tl.tensor,
    min_scaled_ptr: tl.tensor,
    part_value_ptr: tl.tensor,
    part_index_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_rows: int,
    vocab: int,
    row_stride: int,
    tiles_per_program: int,
    num_parts: int,
    has_temperature: tl.constexpr,
    has_min_scaled: tl.constexpr,
    all_greedy: tl.constexpr,
    single_pass: tl.constexpr,
    rows_per_program: tl.constexpr,
    block: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * rows_per_program + tl.arange(0, rows_per_program)
    part = tl.program_id(1)
    row_ok = rows < num_rows
    if not all_greedy:
        greedy = tl.load(greedy_ptr + rows, mask=row_ok, other=1) != 0
        seeds = tl.load(seeds_ptr + rows, mask=row_ok, other=0)
    if has_temperature:
        temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)
    if has_min_scaled:
        min_scaled = tl.load(min_scaled_ptr + rows, mask=row_ok, other=float("-inf"))
    first_col = part * tiles_per_program * block
    best_value = tl.full([rows_per_program], float("-inf"), tl.float32)
    best_index = tl.zeros([rows_per_program], tl.int32) + first_col
    row_base = rows.to(tl.int64) * row_stride
    for tile in range(tiles_per_program):
        tile_col = first_col + tile * block
        cols = tile_col + tl.arange(0, block)
        mask = row_ok[:, None] & (cols < vocab)[None, :]
        logits = tl.load(logits_ptr + row_base[:, None] + cols[None, :], mask=mask, other=float("-inf"))
        scaled = logits.to(tl.float32)
        if has_temperature:  # rounded like torch's ``logits / temperature``, so floors compare exactly
            scaled = tl.math.div_rn(scaled, temperature[:, None])
        keep = mask & (scaled == scaled)  # NaN never wins
        if has_min_scaled:
            keep = keep & (scaled >= min_scaled[:, None])
        if all_greedy:
            score = scaled
        else:
            counters = tl.broadcast_to(cols[None, :], [rows_per_program, block])
            bits = tl.randint(tl.broadcast_to(seeds[:, None], [rows_per_program, block]), counters)
            score = tl.where(greedy[:, None], scaled, scaled - tl.log(_exponential_noise(bits)))
        score = tl.where(keep, score, float("-inf"))
        tile_best, tile_arg = tl.max(score, axis=1, return_indices=True, return_indices_tie_break_left=True)
        better = tile_best > best_value  # strict: an earlier tile keeps its ties
        best_index = tl.where(better, tile_col + tile_arg, best_index)
        best_value = tl.where(better, tile_best, best_value)
    if single_pass:
        tl.store(out_ptr + rows, best_index.to(tl.int64), mask=row_ok)
    else:
        parts = rows.to(tl.int64) * num_parts + part
        tl.store(part_value_ptr + parts, best_value, mask=row_ok)
        tl.store(part_index_ptr + parts, best_index, mask=row_ok)


@triton.jit(do_not_specialize=["num_rows", "num_parts"])
def _pick_best_part_kernel(
    part_value_ptr: tl.tensor,
    part_index_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_rows: int,
    num_parts: int,
    rows_per_program: tl.constexpr,
    parts_block: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * rows_per_program + tl.arange(0, rows_per_program)
    parts = tl.arange(0, parts_block)
    row_ok = rows < num_rows
    offsets = rows.to(tl.int64)[:, None] * num_parts + parts[None, :]
    mask = row_ok[:, None] & (parts < num_parts)[None, :]
    values = tl.load(part_value_ptr + offsets, mask=mask, other=float("-inf"))
    _, best_part = tl.max(values, axis=1, return_indices=True, return_indices_tie_break_left=True)
    index = tl.load(part_index_ptr + rows.to(tl.int64) * num_parts + best_part, mask=row_ok, other=0)
    tl.store(out_ptr + rows, index.to(tl.int64), mask=row_ok)


class SamplingGrid(NamedTuple):
    """How ``gumbel_max_sample`` cuts a ``[B, V]`` batch: a function of B, V and the device only."""

    rows_per_program: int
    block: int
    tiles_per_program: int
    num_parts: int  # column ranges per row; 1 means a single pass

    @property
    def single_pass(self) -> bool:
        return self.num_parts == 1


def sampling_grid(num_rows: int, vocab: int, device: torch.device) -> SamplingGrid:
    block = min(BLOCK_V, next_power_of_2(max(vocab, 16)))
    rows_per_program = max(1, min(MAX_ROWS_PER_PROGRAM, ELEMENTS_PER_TILE // block))
    num_tiles = cdiv(vocab, block)
    row_programs = cdiv(num_rows, rows_per_program)
    wanted_parts = cdiv(PROGRAMS_PER_SM * sm_count(device), row_programs)
    tiles_per_program = cdiv(num_tiles, max(1, min(wanted_parts, num_tiles)))
    return SamplingGrid(rows_per_program, block, tiles_per_program, cdiv(num_tiles, tiles_per_program))


def compile_variants(vocab: int, max_rows: int, device: torch.device) -> None:
    """Launch every variant a batch of up to ``max_rows`` rows can reach (single- and multi-pass grids,
    greedy-only or sampled, with or without temperature and floor), so none compiles mid-request."""
    for rows in sorted({1, max_rows}):
        logits = torch.randn(rows, vocab, device=device)
        greedy = torch.zeros(rows, dtype=torch.bool, device=device)
        seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        temperature = torch.ones(rows, device=device)
        argmax(logits)
        gumbel_max_sample(logits, greedy, seeds)
        gumbel_max_sample(logits, greedy, seeds, temperature)
        gumbel_max_sample(logits, greedy, seeds, temperature, logits.max(dim=-1).values - 1.0)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[B, V]`` float logits (ties to the lowest id), spread over the GPU:
    torch's arg-reductions give each row one thread block, so a long row alone takes one SM."""
    return gumbel_max_sample(logits, None, None)


def gumbel_max_sample(
    logits: torch.Tensor,
    greedy: torch.Tensor | None,
    seeds: torch.Tensor | None,
    temperature: torch.Tensor | None = None,
    min_scaled_logit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token ids ``[B]`` (int64), one per row of ``logits`` ``[B, V]``.

    Row ``b`` scales its logits by ``1 / temperature[b]`` (None: unscaled), keeps the tokens whose
    scaled logit is at least ``min_scaled_logit[b]`` (None: all; the row's largest logit must pass),
    and draws from their softmax with Philox noise keyed by ``seeds[b]`` (int64), or takes the argmax
    where ``greedy[b]`` (bool) is set. ``greedy`` None: every row takes the argmax (no seeds needed).
    """
    all_greedy = greedy is None
    if not all_greedy and seeds is None:
        raise ValueError("rows that sample need their noise seeds")
    num_rows, vocab = logits.shape
    require_unit_last_stride("logits", logits)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0 or vocab == 0:
        return out.zero_()
    grid = sampling_grid(num_rows, vocab, logits.device)
    parts_shape = (num_rows, grid.num_parts) if not grid.single_pass else (1,)
    part_value = torch.empty(parts_shape, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(parts_shape, dtype=torch.int32, device=logits.device)
    row_programs = cdiv(num_rows, grid.rows_per_program)
    _gumbel_max_kernel[(row_programs, grid.num_parts)](
        logits,
        temperature if temperature is not None else logits,
        greedy if greedy is not None else logits,
        seeds if seeds is not None else logits,
        min_scaled_logit if min_scaled_logit is not None else logits,
        part_value,
        part_index,
        out,
        num_rows,
        vocab,
        logits.stride(0),
        grid.tiles_per_program,
        grid.num_parts,
        has_temperature=temperature is not None,
        has_min_scaled=min_scaled_logit is not None,
        all_greedy=all_greedy,
        single_pass=grid.single_pass,
        rows_per_program=grid.rows_per_program,
        block=grid.block,
        num_warps=4,
    )
    if not grid.single_pass:
        # Sized for the most parts any batch can have, not this one's: one compiled variant for every B.
        parts_block = next_power_of_2(cdiv(vocab, grid.block))
        rows_per_program = max(1, min(MAX_ROWS_PER_PROGRAM, ELEMENTS_PER_TILE // parts_block))
        _pick_best_part_kernel[(cdiv(num_rows, rows_per_program),)](
            part_value,
            part_index,
            out,
            num_rows,
            grid.num_parts,
            rows_per_program=rows_per_program,
            parts_block=parts_block,
            num_warps=4,
        )
    return out
