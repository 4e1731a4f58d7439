"""Quantized weights: the per-layer method interface, its formats, and the build-time context.

Reading order: :mod:`.method` (the interface a linear layer delegates to), :mod:`.shards` (how a
checkpoint tensor's rows reach a parameter in any format's units), :mod:`.rounding` (the number formats),
:mod:`.per_channel`, :mod:`.block_fp8` and :mod:`.gguf_method` (the methods; GGUF's blocks in
:mod:`.gguf_blocks` and :mod:`.gguf_packed`), :mod:`.config` and :mod:`.published` (which method
a model is built with), :mod:`.context` (how layers find it while the model is built).

This package does not import :mod:`tokenmill.models`; model layers import it.
"""

from tokenmill.quantization.block_fp8 import Fp8BlockLinearMethod
from tokenmill.quantization.config import (
    NO_QUANTIZATION,
    QUANTIZATION_METHODS,
    QuantizationConfig,
    QuantizationName,
    resolve_quantization,
)
from tokenmill.quantization.context import building_with, linear_method, lm_head_method
from tokenmill.quantization.gguf_method import GGUFLinearMethod
from tokenmill.quantization.method import UNQUANTIZED, LinearMethod, UnquantizedLinearMethod
from tokenmill.quantization.per_channel import Fp8LinearMethod, Int8LinearMethod, PerChannelLinearMethod
from tokenmill.quantization.published import published_quantization
from tokenmill.quantization.shards import RowShard

__all__ = [
    "NO_QUANTIZATION",
    "QUANTIZATION_METHODS",
    "UNQUANTIZED",
    "Fp8BlockLinearMethod",
    "Fp8LinearMethod",
    "GGUFLinearMethod",
    "Int8LinearMethod",
    "LinearMethod",
    "PerChannelLinearMethod",
    "QuantizationConfig",
    "QuantizationName",
    "RowShard",
    "UnquantizedLinearMethod",
    "building_with",
    "linear_method",
    "lm_head_method",
    "published_quantization",
    "resolve_quantization",
]
