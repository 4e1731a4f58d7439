"""Projections of many rows with 8-bit weights: both operands in 8 bits on the tensor cores (W8A8).

A prefill or a large decode batch is compute-bound, and Hopper's 8-bit tensor cores do twice the
bfloat16 rate: ``torch._scaled_mm`` multiplies float8 e4m3 operands with a scale per row of each (cuBLASLt
"rowwise" scaling) and ``torch._int_mm`` int8 ones into int32; decode batches of up to 256 rows go to
tokenmill's own GEMM of either dtype instead (:mod:`tokenmill.kernels.w8a8_gemm`, faster there). The
activations are quantized per token by :func:`tokenmill.kernels.quantize_rows.quantize_rows` (one launch);
the weights were quantized per output channel at load. The int8 product is scaled back in one epilogue
launch (:func:`_int8_epilogue_kernel`), since ``_int_mm`` returns raw int32 sums.

``x @ W^T`` with ``W = w_q * w_scale[:, None]`` and ``x ≈ x_q * x_scale`` is
``(x_q @ w_q^T) * x_scale * w_scale^T``: exact up to the two quantizations.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels.quantize_rows import quantize_rows
from tokenmill.kernels.w8a8_gemm import w8a8_gemm, w8a8_gemm_fits

# torch._int_mm's cuBLAS path takes more than 16 rows; fewer are padded with zero rows.
_INT_MM_MIN_ROWS = 17


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + b`` for a float8 e4m3 ``weight`` ``[N, K]`` with float32 ``weight_scale`` ``[N]``; ``x``
    ``[..., K]`` in bfloat16 or float16, quantized per row on the way in. Output in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_rows(rows, torch.float8_e4m3fn)
    if w8a8_gemm_fits(rows.shape[0], weight):  # a decode batch: tokenmill's GEMM streams the weight faster
        out = w8a8_gemm(x_q, weight, x_scale, weight_scale, bias, x.dtype)
    else:
        out = torch._scaled_mm(
            x_q,
            weight.t(),
            scale_a=x_scale,
            scale_b=weight_scale.view(1, -1),
            bias=bias,
            out_dtype=x.dtype,
        )
    return out.view(*x.shape[:-1], weight.shape[0])


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + b`` for an int8 ``weight`` ``[N, K]`` with float32 ``weight_scale`` ``[N]``, ``x``
    quantized to int8 per row; output in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    x_q, x_scale = quantize_rows(rows, torch.int8)
    if w8a8_gemm_fits(num_rows, weight):  # a decode batch, as in fp8_linear
        return w8a8_gemm(x_q, weight, x_scale, weight_scale, bias, x.dtype).view(*x.shape[:-1], -1)
    if num_rows < _INT_MM_MIN_ROWS:
        x_q = torch.nn.functional.pad(x_q, (0, 0, 0, _INT_MM_MIN_ROWS - num_rows))
    sums = torch._int_mm(x_q, weight.t())[:num_rows]
    out = int8_epilogue(sums, x_scale, weight_scale, bias, x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


@triton.jit
def _int8_epilogue_kernel(
    sums_ptr: tl.tensor,
    x_scale_ptr: tl.tensor,
    w_scale_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    cols: int,
    sums_row_stride: int,
    has_bias: tl.constexpr,
    block: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * block + tl.arange(0, block)
    ok = offsets < cols
    sums = tl.load(sums_ptr + row * sums_row_stride + offsets, mask=ok, other=0).to(tl.float32)
    out = sums * tl.load(x_scale_ptr + row) * tl.load(w_scale_ptr + offsets, mask=ok, other=0.0)
    if has_bias:
        out += tl.load(bias_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + offsets, out.to(out_ptr.dtype.element_ty), mask=ok)


def int8_epilogue(
    sums: torch.Tensor,
    x_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``sums * x_scale * weight_scale^T + bias`` in ``out_dtype``, for int32 ``sums`` ``[M, N]``."""
    num_rows, cols = sums.shape
    out = torch.empty(num_rows, cols, dtype=out_dtype, device=sums.device)
    if num_rows:
        block = 1024
        _int8_epilogue_kernel[(num_rows, triton.cdiv(cols, block))](
            sums,
            x_scale,
            weight_scale,
            bias if bias is not None else weight_scale,
            out,
            cols,
            sums.stride(0),
            has_bias=bias is not None,
            block=block,
        )
    return out


def w8a8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`fp8_linear` / :func:`int8_linear` in PyTorch: the rows quantized the same way, the product
    of the dequantized operands in float32."""
    from tokenmill.kernels.quantize_rows import quantize_rows_reference

    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_rows_reference(rows, weight.dtype)
    out = (x_q.float() * x_scale) @ (weight.float() * weight_scale[:, None]).t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
