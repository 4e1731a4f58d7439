"""A projection together with the step before it, so that one GEMV launch can run both.

At decode sizes a decoder block is a chain of small launches; the GEMV (``KernelOptions.gemv``) takes the
RMSNorm before q/k/v and gate/up (:class:`PreNormLinear`), and the gated activation before the down
projection (:class:`GatedActivationLinear`), reading its input once. Other inputs run the two layers one
after the other, each on the path it was bound to.

The two layers stay registered where the checkpoint names them (``input_layernorm``,
``self_attn.qkv_proj``); these layers only refer to them, and hold no weights of their own.
"""

import functools
from collections.abc import Callable

import torch

from tokenmill.kernels.options import KernelOptions
from tokenmill.models.layers.activation import GatedActivation
from tokenmill.models.layers.fusable import FusableLayer
from tokenmill.models.layers.linear import LinearBase, gemv_fits
from tokenmill.models.layers.norm import RMSNorm

Pair = tuple[torch.Tensor, torch.Tensor]


class PreNormLinear(FusableLayer):
    """``linear(norm(hidden + residual))`` and the new residual stream ``hidden + residual``; with no
    residual (the first block, or Gemma, whose residual add comes after its post-norms)
    ``linear(norm(hidden))`` and ``hidden``."""

    def __init__(self, norm: RMSNorm, linear: LinearBase) -> None:
        super().__init__()
        self._layers = (norm, linear)  # in a tuple: not registered as submodules a second time
        self.configure(KernelOptions())

    def configure(self, options: KernelOptions) -> None:
        self.pdl = options.pdl  # launch the GEMV programmatically dependent (tokenmill.kernels.launch)
        self._forward: Callable[[torch.Tensor, torch.Tensor | None], Pair] = self.forward_unfused
        if options.gemv:
            from tokenmill.kernels.gemv import rms_norm_gemv

            self._rms_norm_gemv_kernel = rms_norm_gemv
            self._forward = self.forward_gemv
        elif options.gguf_packed:
            from tokenmill.quantization.gguf_method import fused_packed_linear

            self._fused_packed_linear = functools.partial(
                fused_packed_linear, activations=options.gguf_activations
            )
            self._forward = self.forward_gguf_packed

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> Pair:
        return self._forward(hidden, residual)

    def forward_unfused(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> Pair:
        norm, linear = self._layers
        if residual is None:
            return linear(norm(hidden)), hidden
        normed, residual = norm(hidden, residual)
        return linear(normed), residual

    def forward_gemv(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> Pair:
        """One launch for rows the GEMV takes (and a norm weight of their dtype), out of place."""
        norm, linear = self._layers
        if not (gemv_fits(hidden, linear, prologue=True) and norm.weight.dtype == hidden.dtype):
            return self.forward_unfused(hidden, residual)
        out, residual = self._rms_norm_gemv_kernel(
            hidden,
            linear.weight,
            norm.weight,
            norm.eps,
            residual,
            norm.unit_offset,
            linear.local_bias(),
            pdl=self.pdl,
            weight_scale=linear.gemv_weight_scale(),
        )
        return linear.reduce(out), residual

    def forward_gguf_packed(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> Pair:
        """One C call for a GGUF-packed projection: the norm forms its input rows."""
        from tokenmill.quantization.gguf_prologue import NormPrologue

        norm, linear = self._layers
        prologue = NormPrologue(norm.weight, norm.eps, norm.unit_offset, residual)
        fused = self._fused_packed_linear(linear, hidden, prologue)
        if fused is None:
            return self.forward_unfused(hidden, residual)
        out, total = fused
        assert total is not None  # a norm prologue returns the sum it normalized
        return out, hidden if residual is None else total


class GatedActivationLinear(FusableLayer):
    """``linear(act(gate_up))`` for a fused ``[gate | up]`` input, e.g. an MLP's down projection."""

    def __init__(self, act: GatedActivation, linear: LinearBase) -> None:
        super().__init__()
        self._layers = (act, linear)  # in a tuple: not registered as submodules a second time
        self.configure(KernelOptions())

    def configure(self, options: KernelOptions) -> None:
        self.pdl = options.pdl  # launch the GEMV programmatically dependent (tokenmill.kernels.launch)
        self._forward: Callable[[torch.Tensor], torch.Tensor] = self.forward_unfused
        if options.gemv:
            from tokenmill.kernels.gemv import gated_gemv

            self._gated_gemv_kernel = gated_gemv
            self._forward = self.forward_gemv
        elif options.gguf_packed:
            from tokenmill.quantization.gguf_method import fused_packed_linear
            from tokenmill.quantization.gguf_prologue import GATE_PROLOGUES

            self._fused_packed_linear = functools.partial(
                fused_packed_linear, activations=options.gguf_activations
            )
            self._gate_prologue = GATE_PROLOGUES[self._layers[0].kind]
            self._forward = self.forward_gguf_packed

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._forward(gate_up)

    def forward_unfused(self, gate_up: torch.Tensor) -> torch.Tensor:
        act, linear = self._layers
        return linear(act(gate_up))

    def forward_gemv(self, gate_up: torch.Tensor) -> torch.Tensor:
        """One launch for rows the GEMV takes: the activation is applied as the input is read."""
        act, linear = self._layers
        if not gemv_fits(gate_up, linear, prologue=True):
            return self.forward_unfused(gate_up)
        out = self._gated_gemv_kernel(
            gate_up,
            linear.weight,
            act.kind,
            linear.local_bias(),
            pdl=self.pdl,
            weight_scale=linear.gemv_weight_scale(),
        )
        return linear.reduce(out)

    def forward_gguf_packed(self, gate_up: torch.Tensor) -> torch.Tensor:
        """One C call for a GGUF-packed projection: the activation forms its input rows."""
        fused = self._fused_packed_linear(self._layers[1], gate_up, self._gate_prologue)
        return self.forward_unfused(gate_up) if fused is None else fused[0]
