"""Building blocks shared by every architecture."""

from tokenmill.models.layers.activation import GeluTanhAndMul, SiluAndMul, gelu_tanh
from tokenmill.models.layers.attention import Attention
from tokenmill.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tokenmill.models.layers.norm import LayerNorm, RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "GeluTanhAndMul",
    "LayerNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "gelu_tanh",
]
