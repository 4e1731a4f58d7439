"""The attention layer as model code sees it: projections in, projections out, the cache hidden."""

import torch
from torch import nn

from tokenmill.attention import AttentionLayer, PendingRotary, attention


class Attention(nn.Module):
    """Reshapes packed ``[T, heads * head_dim]`` projections and attends through the forward context."""

    def __init__(self, spec: AttentionLayer) -> None:
        super().__init__()
        self.spec = spec

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary: PendingRotary | None = None
    ) -> torch.Tensor:
        """Attention of the projected q/k/v; ``rotary``: the rotation q and k still need (the backend
        applies it, or fuses it into its kernel)."""
        spec = self.spec
        q = query.view(-1, spec.num_heads, spec.head_dim)
        k = key.view(-1, spec.num_kv_heads, spec.head_dim)
        v = value.view(-1, spec.num_kv_heads, spec.head_dim)
        return attention(spec, q, k, v, rotary).reshape(-1, spec.num_heads * spec.head_dim)
