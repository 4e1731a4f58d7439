"""Top-p draws without a sort: draw from the whole row, keep the token if it lies in the top-p set, else
draw again among the tokens ahead of it.

The top-p set of a row is the shortest prefix of its tokens in descending order (ties in id order) whose
probability reaches p; a token is in it exactly when the probability of the tokens ahead of it is below p.
One program per row group: a first pass finds each row's maximum and softmax normalizer over the tokens
top-k keeps; then each round takes the Gumbel-max token among those that may still be in the set (at or
above the min-p / top-k floor, ahead of the last rejected token), and a second pass sums the probability
ahead of it. Below p, the token is the sample; otherwise it and every token behind it are out of the set.

Every round uses the same noise (Philox keyed by the row's seed, counted by the token id, as
``kernels.sampling`` draws), so the rounds walk up the Gumbel-max winners of shrinking supersets of the
set until one lies in it: that is the Gumbel-max token of the set itself, an exact sample, and the same
token the sort-then-draw path gives (up to float32 rounding of the cumulative probability at the cut).
A first draw lands in the set with probability about p, so a row takes ~1.1 rounds on average, each two
passes over the row, where a sort costs many. Greedy rows and rows without top-p take their first draw.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import require_unit_last_stride
from tokenmill.kernels.sampling import _exponential_noise

BLOCK_V = 2048  # columns per tile
ELEMENTS_PER_TILE = 2048  # narrow rows are batched several to a program, up to about this many elements
MAX_ROWS_PER_PROGRAM = 64


@triton.jit
def _scaled_tile(row_ptrs, cols, vocab, temperature):  # type: ignore[no-untyped-def]
    """``[R, block]`` of the rows divided by their temperature, rounded as torch's division (-inf past
    the row's end)."""
    mask = (cols < vocab)[None, :]
    logits = tl.load(row_ptrs[:, None] + cols[None, :], mask=mask, other=float("-inf"))
    return tl.math.div_rn(logits.to(tl.float32), temperature[:, None])


@triton.jit
def _rows_max_and_normalizer(  # type: ignore[no-untyped-def]
    row_ptrs, temperature, mass_floor, vocab, rows: tl.constexpr, block: tl.constexpr
):
    """Per row: the largest scaled logit top-k keeps and the sum of exp(scaled - largest) over those."""
    largest = tl.full([rows], float("-inf"), tl.float32)
    total = tl.zeros([rows], tl.float32)
    for start in range(0, vocab, block):
        cols = start + tl.arange(0, block)
        scaled = _scaled_tile(row_ptrs, cols, vocab, temperature)
        kept = (cols < vocab)[None, :] & (scaled >= mass_floor[:, None])
        new_largest = tl.maximum(largest, tl.max(tl.where(kept, scaled, float("-inf")), axis=1))
        rescale = tl.where(new_largest == float("-inf"), 0.0, tl.exp(largest - new_largest))
        terms = tl.where(kept, tl.exp(scaled - new_largest[:, None]), 0.0)
        total = total * rescale + tl.sum(terms, axis=1)
        largest = new_largest
    return largest, total


@triton.jit(do_not_specialize=["num_rows"])
def _top_p_draw_kernel(
    logits_ptr: tl.tensor,
    temperature_ptr: tl.tensor,
    greedy_ptr: tl.tensor,
    seeds_ptr: tl.tensor,
    top_p_ptr: tl.tensor,
    mass_floor_ptr: tl.tensor,
    draw_floor_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_rows: int,
    vocab: int,
    row_stride: int,
    rows: tl.constexpr,
    block: tl.constexpr,
) -> None:
    row = tl.program_id(0) * rows + tl.arange(0, rows)
    row_ok = row < num_rows
    row_ptrs = logits_ptr + tl.where(row_ok, row, 0).to(tl.int64) * row_stride
    temperature = tl.load(temperature_ptr + row, mask=row_ok, other=1.0)
    sampled = tl.load(greedy_ptr + row, mask=row_ok, other=1) == 0
    seed = tl.load(seeds_ptr + row, mask=row_ok, other=0)
    top_p = tl.load(top_p_ptr + row, mask=row_ok, other=2.0)
    mass_floor = tl.load(mass_floor_ptr + row, mask=row_ok, other=0.0)
    draw_floor = tl.load(draw_floor_ptr + row, mask=row_ok, other=0.0)
    largest, total = _rows_max_and_normalizer(row_ptrs, temperature, mass_floor, vocab, rows, block)
    needed = top_p * total  # a token is in the set when the mass ahead of it is below this
    # Tokens at or behind the pivot (the last rejected token) are out; at first, one behind every token.
    pivot_value = tl.full([rows], float("-inf"), tl.float32)
    pivot_id = tl.zeros([rows], tl.int32) + vocab
    token = tl.zeros([rows], tl.int32)
    searching = row_ok
    while tl.max(searching.to(tl.int32), axis=0) > 0:
        best_score = tl.full([rows], float("-inf"), tl.float32)
        drawn = tl.zeros([rows], tl.int32)
        for start in range(0, vocab, block):
            cols = start + tl.arange(0, block)
            scaled = _scaled_tile(row_ptrs, cols, vocab, temperature)
            ahead = (scaled > pivot_value[:, None]) | (
                (scaled == pivot_value[:, None]) & (cols[None, :] < pivot_id[:, None])
            )
            allowed = (cols < vocab)[None, :] & (scaled == scaled) & (scaled >= draw_floor[:, None]) & ahead
            counters = tl.broadcast_to(cols[None, :], [rows, block])
            bits = tl.randint(tl.broadcast_to(seed[:, None], [rows, block]), counters)
            score = tl.where(sampled[:, None], scaled - tl.log(_exponential_noise(bits)), scaled)
            score = tl.where(allowed, score, float("-inf"))
            tile_best, tile_arg = tl.max(
                score, axis=1, return_indices=True, return_indices_tie_break_left=True
            )
            better = tile_best > best_score  # strict: an earlier tile keeps its ties
            drawn = tl.where(better, start + tile_arg, drawn)
            best_score = tl.where(better, tile_best, best_score)
        token = tl.where(searching & (best_score > float("-inf")), drawn, token)
        value = tl.math.div_rn(tl.load(row_ptrs + token).to(tl.float32), temperature)
        checking = searching & sampled & (top_p < 1.0)
        mass_ahead = tl.zeros([rows], tl.float32)
        if tl.max(checking.to(tl.int32), axis=0) > 0:
            for start in range(0, vocab, block):
                cols = start + tl.arange(0, block)
                scaled = _scaled_tile(row_ptrs, cols, vocab, temperature)
                ahead_of_token = (scaled > value[:, None]) | (
                    (scaled == value[:, None]) & (cols[None, :] < token[:, None])
                )
                counted = (cols < vocab)[None, :] & (scaled >= mass_floor[:, None]) & ahead_of_token
                mass_ahead += tl.sum(tl.where(counted, tl.exp(scaled - largest[:, None]), 0.0), axis=1)
        # A row with nothing left to draw keeps its last token (the largest, where top-p rounds to 0 in
        # float32; a fully masked row, token 0): no round may repeat forever.
        searching = checking & (mass_ahead >= needed) & (best_score > float("-inf"))
        pivot_value = tl.where(searching, value, pivot_value)
        pivot_id = tl.where(searching, token, pivot_id)
    tl.store(out_ptr + row, token.to(tl.int64), mask=row_ok)


def top_p_draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    top_p: torch.Tensor,
    mass_floor: torch.Tensor,
    draw_floor: torch.Tensor,
) -> torch.Tensor:
    """Token ids ``[B]`` (int64) for float ``[B, V]`` raw ``logits``. Row ``b`` scales by
    ``1 / temperature[b]``; top-p's probabilities are over the tokens whose scaled logit is at least
    ``mass_floor[b]`` (top-k's; -inf: all); the draw is among those at least ``draw_floor[b]`` (top-k's
    and min-p's) and in the top-p set of ``top_p[b]`` (>= 1: off), with Philox noise keyed by
    ``seeds[b]``; ``greedy[b]`` rows take the argmax."""
    num_rows, vocab = logits.shape
    require_unit_last_stride("logits", logits)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    rows = max(1, min(MAX_ROWS_PER_PROGRAM, ELEMENTS_PER_TILE // block))
    _top_p_draw_kernel[(triton.cdiv(num_rows, rows),)](
        logits,
        temperature,
        greedy,
        seeds,
        top_p,
        mass_floor,
        draw_floor,
        out,
        num_rows,
        vocab,
        logits.stride(0),
        rows=rows,
        block=block,
        num_warps=8,
    )
    return out


def compile_variants(vocab: int, device: torch.device) -> None:
    """Launch the kernel once for this vocabulary (its only variant), so it does not compile mid-request."""
    logits = torch.randn(1, vocab, device=device)
    ones, zeros = torch.ones(1, device=device), torch.zeros(1, device=device)
    floor = torch.full((1,), float("-inf"), device=device)
    seeds = torch.zeros(1, dtype=torch.int64, device=device)
    greedy = torch.zeros(1, dtype=torch.bool, device=device)
    top_p_draw(logits, ones, greedy, seeds, zeros + 0.5, floor, floor)
