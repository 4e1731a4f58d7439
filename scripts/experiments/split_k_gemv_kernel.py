"""Exploration for issue 18: the one-row tensor-core GEMV of 8-bit weights split over the input features,
for the narrow projections (q/k/v, o, down of Llama-3.1-8B) that have too few ``block_n``-row tiles to fill
an H200 on their own (``kernels/gemv_tensor_core.py`` at 64 rows: 64-96 programs for 132 SMs).

Programs form a grid of (row tile, input slice). Each one streams its slice of its rows through ``tl.dot``
(the input row repeated to 16 rows, as in the landed kernel), computing the prologue only for its slice:
a gated prologue (SwiGLU before down_proj) is then computed once per row tile over the whole input, not
once per 8-row program as on the CUDA cores. Its partial sums, and its slice's sum of squares for the
norm prologues, go to a float32 workspace; the last program of a row tile to arrive (a counter per tile,
incremented with acquire-release order, reset by that program for the next call) adds the slices, applies
the row scales and ``1 / rms``, and writes the output. Program (0, s) writes slice s of the new residual.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels.gemv_tensor_core import DOT_ROWS, _converted
from tokenmill.kernels.gemv_tiles import input_tile, weight_tile
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel


@triton.jit
def split_k_gemv_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    weight_ptr,
    weight_scale_ptr,
    out_ptr,
    new_residual_ptr,
    partial_ptr,
    squares_ptr,
    counter_ptr,
    out_features,
    in_features,
    weight_row_stride,
    eps,
    prologue: tl.constexpr,
    unit_offset: tl.constexpr,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
    slice_cols: tl.constexpr,
    slices: tl.constexpr,
    packed: tl.constexpr,
    precision: tl.constexpr,
    pdl: tl.constexpr,
):
    tile = tl.program_id(0)
    part = tl.program_id(1)
    features = tile * block_n + tl.arange(0, block_n)
    feature_ok = features < out_features
    weight_rows = weight_ptr + features.to(tl.int64)[:, None] * weight_row_stride
    written_cols = tl.where(tile == 0, in_features, 0)
    wait_for_previous_kernel(pdl)
    dtype = x_ptr.dtype.element_ty
    sums = tl.zeros([DOT_ROWS, block_n], tl.float32)
    squares = tl.zeros([block_k], tl.float32)
    begin = part * slice_cols
    for start in range(begin, begin + slice_cols, block_k):
        cols = start + tl.arange(0, block_k)
        x, x_squares = input_tile(
            x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr, cols, cols < in_features, written_cols,
            in_features, prologue, unit_offset,
        )  # fmt: skip
        weight = weight_tile(weight_rows, feature_ok, start, in_features, block_k)
        rows = tl.broadcast_to(x.to(dtype)[None, :], (DOT_ROWS, block_k))
        sums = tl.dot(rows, tl.trans(_converted(weight, dtype, packed)), sums, input_precision=precision)
        squares += x_squares
    first = tl.arange(0, DOT_ROWS)[:, None] == 0
    partial = tl.sum(tl.where(first, sums, 0.0), axis=0)
    tl.store(partial_ptr + part * out_features + features, partial, mask=feature_ok)
    tl.store(squares_ptr + tile * slices + part, tl.sum(squares, axis=0))
    tl.debug_barrier()  # every thread's stores before the counter's release
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
    if arrived == slices - 1:
        total = tl.zeros([block_n], tl.float32)
        sum_of_squares = 0.0
        for other in tl.static_range(slices):
            total += tl.load(
                partial_ptr + other * out_features + features,
                mask=feature_ok,
                other=0.0,
                cache_modifier=".cg",
            )
            sum_of_squares += tl.load(squares_ptr + tile * slices + other, cache_modifier=".cg")
        out = total * tl.load(weight_scale_ptr + features, mask=feature_ok, other=0.0)
        if prologue == 1 or prologue == 2:
            out = out / tl.sqrt(sum_of_squares / in_features + eps)
        tl.store(out_ptr + features, out.to(out_ptr.dtype.element_ty), mask=feature_ok)
        tl.store(counter_ptr + tile, 0)  # ready for the next call (CUDA graphs replay the same counters)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed once; each call's last programs leave them zero again."""
    key = (device, tiles)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def launch_split_k_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out: torch.Tensor,
    block: tuple[int, int, int, int],
    slice_cols: int,
    prologue: int,
    pdl: bool,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
    eps: float = 0.0,
    unit_offset: bool = False,
) -> None:
    """``out`` ``[1, N]`` from ``x`` and an 8-bit ``weight`` ``[N, K]``; ``slice_cols`` (a multiple of
    ``block[1]``) input features per program."""
    block_n, block_k, warps, stages = block
    out_features, in_features = weight.shape
    if slice_cols % block_k:
        raise ValueError(f"slice_cols {slice_cols} is not a multiple of block_k {block_k}")
    tiles, slices = triton.cdiv(out_features, block_n), triton.cdiv(in_features, slice_cols)
    partial = torch.empty(slices, out_features, dtype=torch.float32, device=x.device)
    squares = torch.empty(tiles, slices, dtype=torch.float32, device=x.device)
    split_k_gemv_kernel[(tiles, slices)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        weight, weight_scale, out, new_residual if new_residual is not None else out,
        partial, squares, _counters(x.device, tiles), out_features, in_features, weight.stride(0), eps,
        prologue=prologue, unit_offset=unit_offset, block_n=block_n, block_k=block_k, slice_cols=slice_cols,
        slices=slices, packed=x.dtype == torch.bfloat16 and x.is_cuda,
        precision="ieee" if x.dtype == torch.float32 else "tf32", pdl=pdl, num_warps=warps,
        num_stages=stages, **launch_options(pdl),
    )  # fmt: skip
