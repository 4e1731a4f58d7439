"""Building blocks shared by every architecture."""

from tokenmill.models.layers.activation import (
    GATED_ACTIVATIONS,
    GatedActivation,
    GeluTanhAndMul,
    SiluAndMul,
    gelu_tanh,
)
from tokenmill.models.layers.attention import Attention
from tokenmill.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.layers.fusable import FusableLayer
from tokenmill.models.layers.fused import GatedActivationLinear, PreNormLinear
from tokenmill.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.models.layers.norm import LayerNorm, RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding

__all__ = [
    "GATED_ACTIVATIONS",
    "Attention",
    "ColumnParallelLinear",
    "FusableLayer",
    "GatedActivation",
    "GatedActivationLinear",
    "GeluTanhAndMul",
    "LayerNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "PreNormLinear",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "gelu_tanh",
]
