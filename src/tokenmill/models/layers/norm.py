"""Normalization layers. ``forward(x, residual)`` fuses the residual add, returning the new residual too.

With ``use_triton`` set (``CausalLM.use_kernels``), RMSNorm runs ``tokenmill.kernels.rmsnorm`` instead:
one launch for the add and the norm, the residual updated in place. Same rounding points either way.
"""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * w``; with ``unit_offset`` (Gemma) the scale is ``1 + w`` and applied in float32."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.use_triton = False
        self.pdl = False  # launch the kernel programmatically dependent (tokenmill.kernels.launch)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        """``norm(x)``, or ``(norm(x + residual), x + residual)``; the fused path writes the sum into
        ``residual``'s storage (the decoder layers hand the residual stream along and keep no other copy)."""
        if self.use_triton:
            return self._triton_forward(x, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _triton_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from tokenmill.kernels.rmsnorm import add_rms_norm, rms_norm

        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.unit_offset, self.pdl)
        return add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset, self.pdl)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
