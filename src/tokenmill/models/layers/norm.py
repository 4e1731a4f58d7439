"""Normalization layers. RMSNorm can fuse the residual add: ``norm(x, residual)`` also returns the sum.

Configured with ``KernelOptions.rms_norm``, RMSNorm runs ``tokenmill.kernels.rmsnorm`` instead: one
launch for the add and the norm, the residual updated in place. Same rounding points either way.
"""

from collections.abc import Callable
from typing import overload

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.options import KernelOptions
from tokenmill.models.layers.fusable import FusableLayer

Pair = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(FusableLayer):
    """``x / rms(x) * w``; with ``unit_offset`` (Gemma) the scale is ``1 + w`` and applied in float32."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.configure(KernelOptions())

    def configure(self, options: KernelOptions) -> None:
        self.pdl = options.pdl  # launch the kernels programmatically dependent (tokenmill.kernels.launch)
        self._norm: Callable[[torch.Tensor], torch.Tensor] = self.norm_torch
        self._add_norm: Callable[[torch.Tensor, torch.Tensor], Pair] = self.add_norm_torch
        if options.rms_norm:
            from tokenmill.kernels.rmsnorm import add_rms_norm, rms_norm

            self._rms_norm_kernel, self._add_rms_norm_kernel = rms_norm, add_rms_norm
            self._norm, self._add_norm = self.norm_triton, self.add_norm_triton

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> Pair: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | Pair:
        """``norm(x)``, or ``(norm(x + residual), x + residual)``; the Triton path writes the sum into
        ``residual``'s storage (the decoder layers hand the residual stream along and keep no other copy)."""
        return self._norm(x) if residual is None else self._add_norm(x, residual)

    def norm_torch(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def add_norm_torch(self, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        x = x + residual
        return self.norm_torch(x), x

    def norm_triton(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms_norm_kernel(x, self.weight, self.eps, self.unit_offset, self.pdl)

    def add_norm_triton(self, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        return self._add_rms_norm_kernel(x, residual, self.weight, self.eps, self.unit_offset, self.pdl)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
