"""Attention backends: swappable implementations of packed, variable-length, paged attention."""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.attention.metadata import AttentionMetadata, KVCacheLayer


@dataclass(frozen=True)
class AttentionLayer:
    """The static facts of one attention layer that a backend needs."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = (
        None  # a query attends to at most this many most recent keys, itself included
    )


@dataclass(frozen=True)
class PendingRotary:
    """The rotary embedding that query and key still need, handed to the backend so that a kernel may
    apply it on the way (the Triton decode kernel does); any backend may simply call ``apply`` first."""

    positions: torch.Tensor  # [T]
    apply: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (q, k) -> rotated
    # [max_positions, head_dim], cos then sin, for a rotation of the whole head (rotate-half); None when
    # only ``apply`` can do it (e.g. a partial rotary dimension)
    cos_sin_cache: torch.Tensor | None


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        kv_cache: KVCacheLayer | None,
        rotary: PendingRotary | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Rotate query and key (``rotary``), write the new K/V into ``kv_cache`` (when given) and attend
        causally over each sequence."""
