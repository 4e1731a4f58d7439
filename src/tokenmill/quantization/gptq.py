"""Calibrated rounding into the per-channel formats the engine reads (GPTQ: Frantar et al., 2022).

Rounding to nearest treats every weight alone. GPTQ rounds a weight's columns (input features) one after
another and moves each column's rounding error onto the columns not rounded yet, in proportion to how
the layer's inputs correlate (``H = X^T X`` over calibration inputs ``X``), so that the layer's outputs on
such inputs move least. The result keeps the format: int8 or e4m3 codes with one float32 scale per output
row, the scale at-load quantization would take (``amax / 127``, ``amax / 448``), read by the same kernels.

Rows do not interact (the error moves along its own row), so the q / k / v tensors of a checkpoint rounded
apart with their shared input's ``H`` are rounded as the fused weight would be.
"""

from typing import Literal

import torch

from tokenmill.quantization.rounding import FP8_DTYPE, FP8_MAX, INT8_MAX, row_amax

WeightFormat = Literal["int8", "fp8"]
# Share of H's mean diagonal added to its diagonal, so that it inverts; GPTQ's paper takes 0.01. With
# 4,096 calibration tokens, 0.1 kept Gemma 3 270M closer to its float model in both formats
# (reports/accuracy-cpu/gptq.md).
DAMPING = 0.1
BLOCK_COLUMNS = 128  # columns rounded before their accumulated error reaches the later ones in one product


def grid_codes(values: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """``values`` (already divided by their row's scale) rounded to the format's nearest code, as floats."""
    if fmt == "int8":
        return values.round().clamp(-INT8_MAX, INT8_MAX)
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(values.dtype)


def format_max(fmt: WeightFormat) -> float:
    return float(INT8_MAX if fmt == "int8" else FP8_MAX)


def to_format(codes: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """Codes held as floats in their storage dtype (int8 or float8_e4m3fn)."""
    return codes.to(torch.int8) if fmt == "int8" else codes.to(FP8_DTYPE)


def gptq_round(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: WeightFormat,
    damping: float = DAMPING,
    order_by_input: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` for ``weight`` ``[out, in]``: ``codes`` int8 or float8_e4m3fn ``[out, in]``,
    ``scale`` float32 ``[out]`` (``codes * scale[:, None]`` approximates ``weight``), rounded against
    ``hessian`` ``[in, in]`` (``X^T X`` of the layer's calibration inputs). ``order_by_input``: the columns
    whose inputs are largest (H's diagonal) are rounded first, while most columns can still absorb error."""
    columns = weight.shape[1]
    if hessian.shape != (columns, columns):
        raise ValueError(f"the Hessian is {tuple(hessian.shape)}, the weight has {columns} input columns")
    scale = row_amax(weight) / format_max(fmt)
    order = torch.argsort(hessian.diagonal(), descending=True) if order_by_input else torch.arange(columns)
    order = order.to(weight.device)
    w = (weight.double() / scale.double()[:, None])[
        :, order
    ]  # in code units: the grid is the integers / e4m3
    upper = _inverse_cholesky(hessian.double()[order][:, order], damping)
    codes = torch.empty_like(w)
    for first in range(0, columns, BLOCK_COLUMNS):
        last = min(first + BLOCK_COLUMNS, columns)
        block = w[:, first:last].clone()
        errors = torch.empty_like(block)
        for i in range(last - first):
            column = first + i
            codes[:, column] = grid_codes(block[:, i], fmt)
            errors[:, i] = (block[:, i] - codes[:, column]) / upper[column, column]
            block[:, i + 1 :] -= errors[:, i, None] * upper[column, column + 1 : last]
        w[:, last:] -= errors @ upper[first:last, last:]
    restored = codes[:, torch.argsort(order)]
    return to_format(restored, fmt), scale


def _inverse_cholesky(hessian: torch.Tensor, damping: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damping * mean(diag H) * I)^-1``; an input that never fired
    (a zero diagonal) gets a unit diagonal, so its column is rounded to nearest and moves no error."""
    h = hessian.clone()
    diagonal = h.diagonal()
    diagonal[diagonal == 0] = 1
    diagonal += damping * diagonal.mean()
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)
