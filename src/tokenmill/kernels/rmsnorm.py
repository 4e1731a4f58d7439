"""RMSNorm, optionally fused with the residual add; same rounding points as ``models/layers/norm.py``.

Llama style: ``w * (x / rms(x)).to(dtype)``. Gemma style (``unit_offset``): ``(x / rms(x) * (1 + w))``
in float32, then cast. The sum of squares is accumulated in float32 either way.

``head_rms_norm_`` normalizes each query and key head of a fused ``[T, q | k | v]`` projection in place
(Qwen3's and Gemma 3's per-head norms): one launch for both, reading the heads where the projection
wrote them, where a norm per tensor would first copy the strided ``q`` and ``k`` out of it.
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


def _tiling(width: int) -> tuple[int, int, int]:
    """Columns (a power of two), rows per program and warps for rows of ``width`` elements."""
    block = next_power_of_2(width)
    rows_per_program = max(1, min(MAX_ROWS_PER_PROGRAM, ELEMENTS_PER_PROGRAM // block))
    return block, rows_per_program, min(8, max(1, rows_per_program * block // 512))


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
    block, rows_per_program, num_warps = _tiling(hidden)
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
        num_warps=num_warps,
        **launch_options(pdl),
    )


@triton.jit(do_not_specialize=["num_tokens"])
def _head_rms_norm_kernel(
    x_ptr: tl.tensor,
    q_weight_ptr: tl.tensor,
    k_weight_ptr: tl.tensor,
    num_tokens: int,
    token_stride: int,
    eps: float,
    num_q_heads: tl.constexpr,
    num_heads: tl.constexpr,  # query heads, then key heads
    head_dim: tl.constexpr,
    unit_offset: tl.constexpr,
    rows_per_program: tl.constexpr,
    block: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    wait_for_previous_kernel(pdl)
    rows = (tl.program_id(0) * rows_per_program + tl.arange(0, rows_per_program)).to(tl.int64)
    token, head = rows // num_heads, rows % num_heads
    cols = tl.arange(0, block)
    col_ok = cols < head_dim
    mask = (token < num_tokens)[:, None] & col_ok[None, :]
    ptrs = x_ptr + token[:, None] * token_stride + (head * head_dim)[:, None] + cols[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    normed = x32 * (1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / head_dim + eps))[:, None]
    q_weight = tl.load(q_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    k_weight = tl.load(k_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    weight = tl.where((head < num_q_heads)[:, None], q_weight[None, :], k_weight[None, :])
    y = normed * (1.0 + weight) if unit_offset else normed.to(x.dtype).to(tl.float32) * weight
    tl.store(ptrs, y.to(x.dtype), mask=mask)


def head_rms_norm_(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_k_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
    pdl: bool = False,
) -> None:
    """Normalize, in place, each of the ``num_q_heads`` query heads and ``num_k_heads`` key heads at the
    start of every row of ``qkv`` (``[T, >= (num_q_heads + num_k_heads) * head_dim]``, unit last stride),
    with ``q_weight`` and ``k_weight`` (``[head_dim]``, of ``qkv``'s dtype unless ``unit_offset``)."""
    require_unit_last_stride("qkv", qkv)
    if qkv.dim() != 2 or qkv.shape[1] < (num_q_heads + num_k_heads) * head_dim:
        raise ValueError(
            f"qkv {list(qkv.shape)} does not hold {num_q_heads} + {num_k_heads} heads of {head_dim}"
        )
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight.shape != (head_dim,):
            raise ValueError(f"{name} shape {list(weight.shape)} does not match head_dim {head_dim}")
    if not unit_offset and _out_dtype(qkv, q_weight, False) != qkv.dtype:
        raise ValueError(f"in place needs weights of {qkv.dtype}, got {q_weight.dtype}")
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    block, rows_per_program, num_warps = _tiling(head_dim)
    num_heads = num_q_heads + num_k_heads
    grid = (triton.cdiv(num_tokens * num_heads, rows_per_program),)
    _head_rms_norm_kernel[grid](
        qkv,
        q_weight.contiguous(),
        k_weight.contiguous(),
        num_tokens,
        qkv.stride(0),
        eps,
        num_q_heads=num_q_heads,
        num_heads=num_heads,
        head_dim=head_dim,
        unit_offset=unit_offset,
        rows_per_program=rows_per_program,
        block=block,
        pdl=pdl,
        num_warps=num_warps,
        **launch_options(pdl),
    )
