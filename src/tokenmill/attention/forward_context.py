"""The forward context: the step's attention metadata, backend and KV pool, set by the runner around a
forward pass, so model code calls :func:`attention` with only its own tensors."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionLayer, PendingRotary
from tokenmill.attention.metadata import AttentionMetadata, KVCacheLayer


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    backend: AttentionBackend
    kv_caches: Sequence[KVCacheLayer] | None = None  # indexed by layer; None recomputes everything


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("the model was called outside forward_context(); the engine sets one per step")
    return _current


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def attention(
    layer: AttentionLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotary: PendingRotary | None = None,
) -> torch.Tensor:
    """The call model code makes: dispatches to the backend and KV cache of the current forward context."""
    ctx = get_forward_context()
    kv_cache = ctx.kv_caches[layer.layer_idx] if ctx.kv_caches is not None else None
    return ctx.backend.forward(layer, query, key, value, ctx.metadata, kv_cache, rotary)
