"""Dynamic per-row (per-token) quantization of activations to int8 or float8 e4m3, one launch.

8-bit GEMMs (``torch._scaled_mm``, ``torch._int_mm``) take both operands in 8 bits; the weights are
quantized once at load, the activations at every step. Done in PyTorch that is an abs, a max, a divide, a
round, a clamp and a cast, each a launch and a pass over the activations: about 60 µs per projection on an
H200, more than the 8-bit GEMM saves. Here one program per row finds the row's absolute maximum and writes
the quantized row and its scale (``amax / q_max``), so ``row ≈ q * scale``.

Rounding to int8 is half away from zero (the tie rule of CUDA's ``roundf``), which
:func:`quantize_rows_reference` follows; float8 rounds to nearest-even in the cast, as PyTorch's does.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_power_of_2, require_unit_last_stride

Q_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_MIN_SCALE = 1e-12  # an all-zero row gets this scale (and zeros), not a division by zero
_BLOCK = 2048


@triton.jit
def _quantize_rows_kernel(
    x_ptr: tl.tensor,
    q_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    cols: int,
    x_row_stride: int,
    q_max: float,
    to_int: tl.constexpr,
    block: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    amax = tl.zeros([block], tl.float32)
    for start in range(0, cols, block):
        offsets = start + tl.arange(0, block)
        x = tl.load(x_row + offsets, mask=offsets < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / q_max, 1e-12)
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, block):
        offsets = start + tl.arange(0, block)
        ok = offsets < cols
        y = tl.load(x_row + offsets, mask=ok, other=0.0).to(tl.float32) / scale
        if to_int:
            y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
        y = tl.minimum(tl.maximum(y, -q_max), q_max)
        tl.store(q_ptr + row * cols + offsets, y.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as ``dtype`` (int8 or float8_e4m3fn) ``[M, K]`` and float32 scales ``[M, 1]``."""
    if dtype not in Q_MAX:
        raise ValueError(f"quantize_rows makes int8 or float8_e4m3fn rows, not {dtype}")
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes [M, K] rows, got {list(x.shape)}")
    require_unit_last_stride("x", x)
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=dtype, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(_BLOCK, next_power_of_2(cols))
        _quantize_rows_kernel[(rows,)](
            x, q, scales, cols, x.stride(0), Q_MAX[dtype], to_int=dtype == torch.int8, block=block
        )
    return q, scales


def quantize_rows_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` in PyTorch (the CPU path, and the kernel's reference)."""
    q_max = Q_MAX[dtype]
    x32 = x.float()
    scales = (x32.abs().amax(dim=-1, keepdim=True) / q_max).clamp(min=_MIN_SCALE)
    y = x32 / scales
    if dtype == torch.int8:
        y = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return y.clamp(-q_max, q_max).to(dtype), scales
