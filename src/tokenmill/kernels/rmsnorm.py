"""RMSNorm, optionally fused with the residual add; same rounding points as ``models/layers/norm.py``.

Llama style: ``w * (x / rms(x)).to(dtype)``. Gemma style (``unit_offset``): ``(x / rms(x) * (1 + w))``
in float32, then cast. The sum of squares is accumulated in float32 either way.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2, require_unit_last_stride
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel

MAX_ROWS_PER_PROGRAM = 16
ELEMENTS_PER_PROGRAM = 2048  # narrow rows (per-head norms) are batched up to about this many elements


@triton.jit(do_not_specialize=["num_rows"])  # the token count changes every step
def _rms_norm_kernel(
    x_ptr: tl.tensor,
    residual_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_rows: int,
    hidden: int,
    x_row_stride: int,
    residual_row_stride: int,
    out_row_stride: int,
    eps: float,
    has_residual: tl.constexpr,
    unit_offset: tl.constexpr,
    rows_per_program: tl.constexpr,
    block: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    wait_for_previous_kernel(pdl)
    rows = (tl.program_id(0) * rows_per_program + tl.arange(0, rows_per_program)).to(tl.int64)
    cols = tl.arange(0, block)
    col_ok = cols < hidden
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    if has_residual:
        residual_ptrs = residual_ptr + rows[:, None] * residual_row_stride + cols[None, :]
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # rounded like ``x + residual``
        tl.store(residual_ptrs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / hidden + eps)
    normed = x32 * inv_rms[:, None]
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if unit_offset:
        y = normed * (1.0 + weight[None, :])
    else:
        y = normed.to(x.dtype).to(tl.float32) * weight[None, :]
    tl.store(
        out_ptr + rows[:, None] * out_row_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False, pdl: bool = False
) -> torch.Tensor:
    """Normalize the last dimension of ``x``; returns a new tensor shaped like ``x``."""
    rows = _as_rows(x)
    out = torch.empty(rows.shape, dtype=_out_dtype(x, weight, unit_offset), device=x.device)
    _launch(rows, None, weight, out, eps, unit_offset, pdl)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` in place, then normalize it: returns ``(normed, residual)``.

    ``residual`` must have ``x``'s shape and dtype and be viewable as rows (contiguous rows of stride
    ``hidden`` or more); it is overwritten with the new residual stream and returned.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.dtype}{list(residual.shape)} != x {x.dtype}{list(x.shape)}")
    rows = _as_rows(x)
    residual_rows = residual.view(-1, residual.shape[-1])
    require_unit_last_stride("residual", residual_rows)
    out = torch.empty(rows.shape, dtype=_out_dtype(x, weight, unit_offset), device=x.device)
    _launch(rows, residual_rows, weight, out, eps, unit_offset, pdl)
    return out.view(x.shape), residual


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, unit_offset: bool) -> torch.dtype:
    # Llama style multiplies ``weight * normed.to(x.dtype)``, so the result takes the promoted type.
    return x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)


def _launch(
    rows: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    unit_offset: bool,
    pdl: bool,
) -> None:
    num_rows, hidden = rows.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {list(weight.shape)} does not match hidden size {hidden}")
    if num_rows == 0:
        return
    block = next_power_of_2(hidden)
    rows_per_program = max(1, min(MAX_ROWS_PER_PROGRAM, ELEMENTS_PER_PROGRAM // block))
    grid = (triton.cdiv(num_rows, rows_per_program),)
    _rms_norm_kernel[grid](
        rows,
        residual if residual is not None else rows,
        weight.contiguous(),
        out,
        num_rows,
        hidden,
        rows.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        eps,
        has_residual=residual is not None,
        unit_offset=unit_offset,
        rows_per_program=rows_per_program,
        block=block,
        pdl=pdl,
        num_warps=min(8, max(1, rows_per_program * block // 512)),
        **launch_options(pdl),
    )
