"""Gated activations over a fused ``[gate | up]`` projection, ``[T, 2I] -> [T, I]``: ``act(gate) * up``.

As in ``models/layers/activation.py``, ``act(gate)`` is rounded to the input dtype before the multiply.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2, require_unit_last_stride
from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel

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
    gate_ptrs = x_ptr + row * x_row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if activation == 0:
        activated = g * tl.sigmoid(g)
    else:
        # gelu_tanh(g) = g * (1 + tanh(u)) / 2 = g * sigmoid(2u), u = sqrt(2/pi) * (g + 0.044715 g^3)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        activated = g * tl.sigmoid(2.0 * inner)
    product = activated.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, product.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """SwiGLU: ``silu(x[..., :I]) * x[..., I:]``; ``pdl``: launched programmatically dependent."""
    return _gated(x, SILU, pdl)


def gelu_tanh_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU: ``gelu_tanh(x[..., :I]) * x[..., I:]``."""
    return _gated(x, GELU_TANH, pdl)


def _gated(x: torch.Tensor, activation: int, pdl: bool) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"the fused [gate | up] dimension must be even, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    require_unit_last_stride("x", rows)
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0] and inter:
        block = min(BLOCK, next_power_of_2(inter))
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _gated_activation_kernel[grid](
            rows, out, inter, rows.stride(0), out.stride(0), activation=activation, block=block, pdl=pdl,
            num_warps=4, **launch_options(pdl),
        )  # fmt: skip
    return out.view(*x.shape[:-1], inter)
