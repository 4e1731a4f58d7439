"""Gated activations over a fused ``[gate | up]`` projection, ``[T, 2I] -> [T, I]``: ``act(gate) * up``.

As in ``models/layers/activation.py``, ``act(gate)`` is rounded to the input dtype before the multiply.
``gated_quantized`` writes the products as 8-bit rows with a scale each (an 8-bit projection's per-token
input quantization, :mod:`tokenmill.kernels.quantize_rows`, in the same launch): one program per row finds
the row's absolute maximum over the products rounded to the input dtype, then recomputes and quantizes
them; exactly what the activation followed by ``quantize_rows`` gives.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2, require_unit_last_stride
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel
from tokenmill.kernels.quantize_rows import Q_MAX, quantized, quantized_rows_buffers, row_scale

BLOCK = 1024
SILU = 0
GELU_TANH = 1


@triton.jit
def _gated_activation_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    inter: int,
    x_row_stride: int,
    out_row_stride: int,
    activation: tl.constexpr,
    block: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    wait_for_previous_kernel(pdl)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * block + tl.arange(0, block)
    mask = cols < inter
    product = _gated_product(x_ptr + row * x_row_stride, cols, mask, inter, activation)
    tl.store(out_ptr + row * out_row_stride + cols, product.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_product(
    row_ptr: tl.tensor, cols: tl.tensor, mask: tl.tensor, inter: int, activation: tl.constexpr
) -> tl.tensor:
    """``act(gate) * up`` at ``cols`` of one row, in float32 (not yet rounded to the input dtype)."""
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0)
    up = tl.load(row_ptr + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if activation == 0:
        activated = g * tl.sigmoid(g)
    else:
        # gelu_tanh(g) = g * (1 + tanh(u)) / 2 = g * sigmoid(2u), u = sqrt(2/pi) * (g + 0.044715 g^3)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        activated = g * tl.sigmoid(2.0 * inner)
    return activated.to(gate.dtype).to(tl.float32) * up.to(tl.float32)


@triton.jit
def _gated_activation_quantized_kernel(
    x_ptr: tl.tensor,
    q_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    inter: int,
    x_row_stride: int,
    q_max: float,
    activation: tl.constexpr,
    to_int: tl.constexpr,
    block: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    wait_for_previous_kernel(pdl)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * x_row_stride
    dtype = x_ptr.dtype.element_ty
    amax = tl.zeros([block], tl.float32)
    for start in range(0, inter, block):
        cols = start + tl.arange(0, block)
        mask = cols < inter
        product = _gated_product(row_ptr, cols, mask, inter, activation).to(dtype).to(tl.float32)
        amax = tl.maximum(amax, tl.where(mask, tl.abs(product), 0.0))
    scale = row_scale(tl.max(amax, axis=0), q_max)
    tl.store(scale_ptr + row, scale)
    for start in range(0, inter, block):
        cols = start + tl.arange(0, block)
        mask = cols < inter
        product = _gated_product(row_ptr, cols, mask, inter, activation).to(dtype).to(tl.float32)
        q = quantized(product, scale, q_max, to_int)
        tl.store(q_ptr + row * inter + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """SwiGLU: ``silu(x[..., :I]) * x[..., I:]``; ``pdl``: launched programmatically dependent."""
    return _gated(x, SILU, pdl)


def gelu_tanh_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU: ``gelu_tanh(x[..., :I]) * x[..., I:]``."""
    return _gated(x, GELU_TANH, pdl)


ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH}


def gated_quantized(
    x: torch.Tensor, activation: str, dtype: torch.dtype, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``act(x[:, :I]) * x[:, I:]`` of ``[M, 2I]`` rows (``activation``: ``silu`` or ``gelu_tanh``) as
    ``dtype`` (int8 or float8_e4m3fn) rows ``[M, I]`` and float32 scales ``[M, 1]``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown gated activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")
    rows, inter = _fused_rows(x)
    q, scales = quantized_rows_buffers(rows.shape[0], inter, dtype, x.device)
    if rows.shape[0] and inter:
        _gated_activation_quantized_kernel[(rows.shape[0],)](
            rows, q, scales, inter, rows.stride(0), Q_MAX[dtype], activation=ACTIVATIONS[activation],
            to_int=dtype == torch.int8, block=min(BLOCK, next_power_of_2(inter)), pdl=pdl, num_warps=4,
            **launch_options(pdl),
        )  # fmt: skip
    return q, scales


def _fused_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x``'s ``[gate | up]`` rows and the width I of each half."""
    if x.shape[-1] % 2:
        raise ValueError(f"the fused [gate | up] dimension must be even, got {x.shape[-1]}")
    rows = x.reshape(-1, x.shape[-1])
    require_unit_last_stride("x", rows)
    return rows, x.shape[-1] // 2


def _gated(x: torch.Tensor, activation: int, pdl: bool) -> torch.Tensor:
    rows, inter = _fused_rows(x)
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0] and inter:
        block = min(BLOCK, next_power_of_2(inter))
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _gated_activation_kernel[grid](
            rows, out, inter, rows.stride(0), out.stride(0), activation=activation, block=block, pdl=pdl,
            num_warps=4, **launch_options(pdl),
        )  # fmt: skip
    return out.view(*x.shape[:-1], inter)
