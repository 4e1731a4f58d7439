"""Gated activations over a fused ``[gate | up]`` projection: ``act(gate) * up``.

With ``use_triton`` set (``CausalLM.use_kernels``), one ``tokenmill.kernels.activation`` launch reads the
projection once and writes the product, rounding ``act(gate)`` to the input dtype as the code below does.
"""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU (Llama, Qwen, Mistral)."""

    def __init__(self) -> None:
        super().__init__()
        self.use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from tokenmill.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU with the tanh approximation of GELU (Gemma)."""

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
