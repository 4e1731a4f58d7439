"""Exploration for issue 18: an 8-bit one-row GEMV whose programs each stream several tiles of weight rows
(a persistent grid, one flattened loop over tile x input step), so that the next tile's first weights are
in flight while a tile's sum is reduced and stored. The landed kernel (``kernels/gemv.py``) runs one tile
per program: at Llama-3.1-8B's shapes that is 4 steps of 8 KB, and every program pays the first load's
latency and its final reduction with nothing in flight.

``prefetch``: the next step's weights are loaded into registers a step ahead (as the landed kernel does);
without it the load sits in the loop and Triton's pipeliner keeps ``num_stages`` steps in flight through
shared memory (asynchronous copies). ``programs`` = the number of tiles gives a one-tile-per-program grid.
Same prologues, tiles and float32 arithmetic as the landed kernel (``gemv_tiles.py``).
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels.gemv_tiles import as_float32, input_tile
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel


@triton.jit
def _weight_step(
    weight_ptr,
    tile,
    k_start,
    out_features,
    in_features,
    weight_row_stride,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
):
    features = tile * block_n + tl.arange(0, block_n)
    cols = k_start + tl.arange(0, block_k)
    return tl.load(
        weight_ptr + features.to(tl.int64)[:, None] * weight_row_stride + cols[None, :],
        mask=(features < out_features)[:, None] & (cols < in_features)[None, :],
        other=0.0,
        eviction_policy="evict_first",
    )


@triton.jit
def flat_gemv_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    weight_ptr,
    weight_scale_ptr,
    out_ptr,
    new_residual_ptr,
    out_features,
    in_features,
    weight_row_stride,
    eps,
    prologue: tl.constexpr,
    unit_offset: tl.constexpr,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
    prefetch: tl.constexpr,
    pdl: tl.constexpr,
):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = tl.cdiv(out_features, block_n)
    if prefetch:
        weight = _weight_step(
            weight_ptr, program, 0, out_features, in_features, weight_row_stride, block_n, block_k
        )
    wait_for_previous_kernel(pdl)
    for tile in range(program, tiles, programs):
        products = tl.zeros([block_n, block_k], tl.float32)
        squares = tl.zeros([block_k], tl.float32)
        written_cols = tl.where(tile == 0, in_features, 0)
        for k_start in range(0, in_features, block_k):
            if not prefetch:
                weight = _weight_step(
                    weight_ptr, tile, k_start, out_features, in_features, weight_row_stride, block_n, block_k
                )
            cols = k_start + tl.arange(0, block_k)
            x, x_squares = input_tile(
                x_ptr, residual_ptr, norm_weight_ptr, new_residual_ptr, cols, cols < in_features,
                written_cols, in_features, prologue, unit_offset,
            )  # fmt: skip
            products += as_float32(weight) * x[None, :]
            squares += x_squares
            if prefetch:  # the next step's weights: this tile's next columns, or the next tile's first
                last = k_start + block_k >= in_features
                weight = _weight_step(
                    weight_ptr, tl.where(last, tile + programs, tile), tl.where(last, 0, k_start + block_k),
                    out_features, in_features, weight_row_stride, block_n, block_k,
                )  # fmt: skip
        features = tile * block_n + tl.arange(0, block_n)
        feature_ok = features < out_features
        out = tl.sum(products, axis=1) * tl.load(weight_scale_ptr + features, mask=feature_ok, other=0.0)
        if prologue == 1 or prologue == 2:
            out = out / tl.sqrt(tl.sum(squares, axis=0) / in_features + eps)
        tl.store(out_ptr + features, out.to(out_ptr.dtype.element_ty), mask=feature_ok)


def launch_flat_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out: torch.Tensor,
    block: tuple[int, int, int, int],
    programs: int,
    prefetch: bool,
    prologue: int,
    in_features: int,
    pdl: bool,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
    eps: float = 0.0,
    unit_offset: bool = False,
) -> None:
    """``programs`` programs (at most one per tile) over ``weight``'s rows in tiles of ``block[0]``."""
    block_n, block_k, warps, stages = block
    grid = min(programs, triton.cdiv(weight.shape[0], block_n))
    flat_gemv_kernel[(grid,)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        weight, weight_scale, out, new_residual if new_residual is not None else out,
        weight.shape[0], in_features, weight.stride(0), eps,
        prologue=prologue, unit_offset=unit_offset, block_n=block_n, block_k=block_k, prefetch=prefetch,
        pdl=pdl, num_warps=warps, num_stages=stages, **launch_options(pdl),
    )  # fmt: skip


@triton.jit
def int8_as_float32_prmt(weight):
    """int8 codes to float32 four at a time (PTX): one xor makes each byte ``v + 128``, one byte permute per
    code places it under float32's exponent of 2**23 (``2**23 + v + 128``), and a float subtract leaves ``v``."""
    biased = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m;
        xor.b32 t, $4, 0x80808080;
        mov.b32 m, 0x4B000000;
        prmt.b32 $0, t, m, 0x7540;
        prmt.b32 $1, t, m, 0x7541;
        prmt.b32 $2, t, m, 0x7542;
        prmt.b32 $3, t, m, 0x7543;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[weight],
        dtype=tl.float32,
        is_pure=True,
        pack=4,
    )
    return biased - 8388736.0
