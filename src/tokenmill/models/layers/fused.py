"""A projection together with the step before it, so that one GEMV launch can run both.

At decode sizes a decoder block is a chain of small launches; the GEMV (``KernelOptions.gemv``) takes the
RMSNorm before q/k/v and gate/up (:class:`PreNormLinear`), and the gated activation before the down
projection (:class:`GatedActivationLinear`), reading its input once. Other inputs run the two layers one
after the other, each on the path it was bound to; for an 8-bit projection that quantizes its input per
token (W8A8) the norm kernel writes that input already quantized (``KernelOptions.input_quant``).

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
from tokenmill.quantization.method import QuantizedInputPath

Pair = tuple[torch.Tensor, torch.Tensor]
HALF_DTYPES = (torch.bfloat16, torch.float16)  # inputs W8A8 projections quantize (float32: the reference)


def quantized_input(linear: LinearBase, options: KernelOptions) -> QuantizedInputPath | None:
    """With ``options.input_quant``, the product of ``linear`` that takes its input quantized per token,
    where its method has one (W8A8 int8 / fp8 on the tensor cores)."""
    return linear.quant_method.quantized_input_path(linear, options) if options.input_quant else None


def takes_quantized_input(x: torch.Tensor, linear: LinearBase) -> bool:
    """Whether ``linear`` quantizes ``x`` per token on its way in: 16-bit rows (float32 ones take the
    weight-only reference) that the GEMV does not take (it reads 16-bit rows as they are)."""
    return x.dim() == 2 and x.dtype in HALF_DTYPES and not gemv_fits(x, linear)


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
        self._rows: Callable[[torch.Tensor, torch.Tensor | None], Pair] = self.forward_unfused
        self._quantized_input = quantized_input(self._layers[1], options) if options.rms_norm else None
        if self._quantized_input is not None:
            from tokenmill.kernels.rmsnorm import rms_norm_quantized

            self._rms_norm_quantized_kernel = rms_norm_quantized
            self._rows = self.forward_quantized_input
        self._forward: Callable[[torch.Tensor, torch.Tensor | None], Pair] = self._rows
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
            return self._rows(hidden, residual)
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

    def forward_quantized_input(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> Pair:
        """The norm's kernel writes the W8A8 projection's input quantized per token (a 16-bit ``hidden``
        of more rows than the GEMV takes; the residual stream updated in place, as the norm's kernel does)."""
        norm, linear = self._layers
        path = self._quantized_input
        if not takes_quantized_input(hidden, linear) or path is None:
            return self.forward_unfused(hidden, residual)
        x_q, x_scale, residual = self._rms_norm_quantized_kernel(
            hidden, norm.weight, norm.eps, path.dtype, residual, norm.unit_offset, self.pdl
        )
        out = linear.reduce(path.multiply(x_q, x_scale, hidden.dtype))
        return out, hidden if residual is None else residual

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
