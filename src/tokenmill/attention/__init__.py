"""The narrow interface between model code and the KV cache.

Model code calls :func:`attention` with the query, key and value of the tokens in this step. Everything
else it needs (where each sequence starts, how much context it has, where to write new K/V, which KV
blocks hold its past) lives in the :class:`ForwardContext` that the caller sets around the forward pass.
"""

from tokenmill.attention.backend import AttentionBackend, AttentionLayer, PendingRotary
from tokenmill.attention.forward_context import (
    ForwardContext,
    attention,
    forward_context,
    get_forward_context,
)
from tokenmill.attention.metadata import AttentionMetadata, KVCacheLayer
from tokenmill.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionLayer",
    "AttentionMetadata",
    "ForwardContext",
    "KVCacheLayer",
    "PendingRotary",
    "TorchAttentionBackend",
    "attention",
    "forward_context",
    "get_forward_context",
]
