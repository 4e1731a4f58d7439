"""Gated activations over a fused ``[gate | up]`` projection: ``act(gate) * up``.

With ``use_triton`` set (``CausalLM.use_kernels``), one ``tokenmill.kernels.activation`` launch reads the
projection once and writes the product, rounding ``act(gate)`` to the input dtype as the code below does.
"""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


class GatedActivation(nn.Module):
    """``act(gate) * up`` over a fused ``[gate | up]`` input; ``kind`` names ``act`` for fused kernels."""

    kind: ClassVar[str]
    use_triton: bool


class SiluAndMul(GatedActivation):
    """SwiGLU (Llama, Qwen, Mistral)."""

    kind = "silu"

    def __init__(self) -> None:
        super().__init__()
        self.use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from tokenmill.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(GatedActivation):
    """GeGLU with the tanh approximation of GELU (Gemma)."""

    kind = "gelu_tanh"

    def __init__(self) -> None:
        super().__init__()
        self.use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from tokenmill.kernels.activation import gelu_tanh_and_mul

            return gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``gelu_new``."""
    return F.gelu(x, approximate="tanh")
