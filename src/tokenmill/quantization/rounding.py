"""The number formats: per-channel int8 and fp8 (e4m3) weights, 128x128 block-scaled fp8 weights, and the
per-token rounding of activations that W8A8 GEMMs apply.

Every scale is float32 and multiplies: ``dequantized = quantized.float() * scale``. A per-channel scale
belongs to one output row, so rows quantize independently: a shard of a fused weight, or a chunk of rows
streamed at load, gets the same bytes as the whole weight would.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
INT8_MAX = 127
_TINY = 1e-12  # an all-zero row gets a tiny scale (and zero weights) rather than a division by zero


def row_amax(rows: torch.Tensor) -> torch.Tensor:
    """``amax(|row|)`` per row in float32, in one pass (no ``abs()`` temporary), never zero."""
    return torch.linalg.vector_norm(rows, ord=float("inf"), dim=-1, dtype=torch.float32).clamp_(min=_TINY)


def quantize_int8_per_channel(
    weight: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: ``scale = amax(|row|) / 127`` (or the given one: a column slice takes its whole
    row's), weights rounded to nearest (ties to even), in place on one float32 temporary."""
    scale = row_amax(weight) / INT8_MAX if scale is None else scale
    scaled = weight / scale[:, None]  # float32 (a bf16 / fp16 weight is promoted, not copied first)
    return scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_fp8_per_channel(
    weight: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with ``scale = amax(|row|) / 448`` (or the given one): each row's largest weight lands on
    fp8's largest value."""
    scale = row_amax(weight) / FP8_MAX if scale is None else scale
    scaled = weight / scale[:, None]
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_per_channel(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``weight.float() * scale[:, None]`` in ``dtype`` (rounded once, from float32)."""
    return (weight.float() * scale[:, None]).to(dtype)


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """A ``[ceil(rows/bn), ceil(cols/bk)]`` block scale repeated over the ``[rows, cols]`` elements."""
    rows, cols = shape
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:rows, :cols]


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per ``block`` of elements (``amax(|block|) / 448``); edge blocks may be partial."""
    rows, cols = weight.shape
    n_rows, n_cols = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(n_rows * block[0], n_cols * block[1], dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(n_rows, block[0], n_cols, block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=_TINY) / FP8_MAX
    quantized = (weight.float() / expand_blocks(scale, block, weight.shape)).clamp(-FP8_MAX, FP8_MAX)
    return quantized.to(FP8_DTYPE), scale


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``weight.float()`` times the scale of its block, in ``dtype``."""
    return (weight.float() * expand_blocks(scale, block, weight.shape)).to(dtype)


def fake_quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded as a W8A8 GEMM rounds its input: each token (row) to ``dtype`` (int8 or e4m3) with
    its own dynamic scale ``amax / max``, then scaled back, in ``x``'s dtype (a PyTorch emulation)."""
    limit = INT8_MAX if dtype == torch.int8 else FP8_MAX
    rows = x.float()
    scale = rows.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / limit
    scaled = (rows / scale).clamp(-limit, limit)
    rounded = torch.round(scaled) if dtype == torch.int8 else scaled.to(dtype).float()
    return (rounded * scale).to(x.dtype)
