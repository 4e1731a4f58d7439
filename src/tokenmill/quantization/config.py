"""Which quantization a model is built with: the user's choice and the checkpoint's, reconciled.

``quantization`` is named as vLLM names it: ``none`` (float weights, or a pre-quantized checkpoint as it
is published), ``int8`` and ``fp8`` (quantize float weights at load, per channel; on a checkpoint
published in that format, load it as published), ``gguf`` (GGUF blocks kept packed on the CPU), and
``auto``, which the loader turns into ``gguf`` or ``none`` (``loading.loader``).
"""

import typing
from dataclasses import dataclass, replace

from tokenmill.config import QuantizationMethod
from tokenmill.errors import ModelLoadError
from tokenmill.quantization.block_fp8 import Fp8BlockLinearMethod
from tokenmill.quantization.gguf_method import GGUFLinearMethod
from tokenmill.quantization.method import UNQUANTIZED, LinearMethod
from tokenmill.quantization.per_channel import Fp8LinearMethod, Int8LinearMethod

QuantizationName = QuantizationMethod
QUANTIZATION_METHODS: tuple[str, ...] = typing.get_args(QuantizationMethod)


@dataclass(frozen=True)
class QuantizationConfig:
    """``method``: the format; ``prequantized``: the checkpoint publishes quantized weights and scales;
    ``weight_block``: block-scaled fp8's block (None: per-channel scales); ``dynamic_activations``: the
    PyTorch paths round each input per token as a W8A8 GEMM would (an emulation, for measuring accuracy);
    ``quantize_lm_head``: an LM head not tied to the embedding is quantized too; ``packed_head``
    (``gguf``): the GGUF file gives the LM head blocks the kernel reads (its ``output`` tensor, or a tied
    head's ``token_embd``: the embedding lookups keep a float copy)."""

    method: str = "none"
    prequantized: bool = False
    weight_block: tuple[int, int] | None = None
    dynamic_activations: bool = False
    quantize_lm_head: bool = True
    packed_head: bool = False

    def linear_method(self) -> LinearMethod:
        if self.method == "int8":
            return Int8LinearMethod(self.prequantized, self.dynamic_activations)
        if self.method == "fp8" and self.weight_block is not None:
            return Fp8BlockLinearMethod(self.weight_block)
        if self.method == "fp8":
            return Fp8LinearMethod(self.prequantized, self.dynamic_activations)
        if self.method == "gguf":
            return GGUFLinearMethod()
        return UNQUANTIZED

    def lm_head_method(self, tied: bool, linear: LinearMethod) -> LinearMethod:
        """``linear`` for an untied head this config quantizes; a tied head reads the float embedding,
        except a GGUF head with blocks of its own (``packed_head``)."""
        if self.method == "gguf":
            return linear if self.packed_head else UNQUANTIZED
        return linear if self.quantize_lm_head and not tied else UNQUANTIZED


NO_QUANTIZATION = QuantizationConfig()


def resolve_quantization(
    requested: "str | QuantizationConfig", published: QuantizationConfig | None, source: str
) -> QuantizationConfig:
    """The config to build with: ``requested`` (a name or a config) against what the checkpoint
    ``published`` (None: float weights). A pre-quantized checkpoint loads as published (with the W8A8
    emulation of ``dynamic_activations`` if a requested config asks for it); asking for another format than
    its own is an error, not a silent re-quantization."""
    wanted = requested if isinstance(requested, QuantizationConfig) else _named(requested)
    if published is None:
        return wanted
    if wanted.method not in ("none", published.method):
        raise ModelLoadError(
            f"{source}: the checkpoint is pre-quantized as '{published.method}'; quantization "
            f"'{wanted.method}' cannot be applied on top (use 'none' or '{published.method}')"
        )
    return replace(published, dynamic_activations=wanted.dynamic_activations)


def _named(name: str) -> QuantizationConfig:
    if name not in QUANTIZATION_METHODS or name == "auto":  # auto is decided by the loader
        raise ModelLoadError(f"quantization '{name}' is not one of: {', '.join(QUANTIZATION_METHODS)}")
    return QuantizationConfig(name)
