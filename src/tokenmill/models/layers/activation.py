"""Gated activations over a fused ``[gate | up]`` projection: ``act(gate) * up``.

Configured with ``KernelOptions.activation``, one ``tokenmill.kernels.activation`` launch reads the
projection once and writes the product, rounding ``act(gate)`` to the input dtype as the code below does.
"""

import functools
from collections.abc import Callable
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from tokenmill.kernels.options import KernelOptions
from tokenmill.models.layers.fusable import FusableLayer

GateKind = Literal["silu", "gelu_tanh"]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's ``gelu_new``, Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


GATE_ACTIVATIONS: dict[GateKind, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": gelu_tanh,
}


class GatedActivation(FusableLayer):
    """``act(gate) * up`` over a fused ``[gate | up]`` input; ``kind`` names ``act`` (for the kernels too)."""

    kind: ClassVar[GateKind]

    def __init__(self) -> None:
        super().__init__()
        self.configure(KernelOptions())

    def configure(self, options: KernelOptions) -> None:
        self._forward: Callable[[torch.Tensor], torch.Tensor] = self.forward_torch
        if options.activation:
            from tokenmill.kernels.activation import gelu_tanh_and_mul, silu_and_mul

            kernel = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}[self.kind]
            self._forward = functools.partial(kernel, pdl=options.pdl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return GATE_ACTIVATIONS[self.kind](gate) * up


class SiluAndMul(GatedActivation):
    """SwiGLU (Llama, Qwen, Mistral)."""

    kind = "silu"


class GeluTanhAndMul(GatedActivation):
    """GeGLU with the tanh approximation of GELU (Gemma)."""

    kind = "gelu_tanh"


# Config names (``hidden_act``, ``hidden_activation``) of the gated activations: transformers' three tanh
# approximations of GELU compute the same function.
GATED_ACTIVATIONS: dict[str, type[GatedActivation]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_new": GeluTanhAndMul,
    "gelu_fast": GeluTanhAndMul,
}
