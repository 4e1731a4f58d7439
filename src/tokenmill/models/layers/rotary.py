"""Rotary position embeddings (rotate-half layout), with Llama 3 and linear frequency scaling.

With ``use_triton`` set (``CausalLM.use_kernels``), ``tokenmill.kernels.rotary`` rotates q and k in place
in one launch, rounding where the PyTorch code below does.
"""

import functools
import math

import torch
from torch import nn

from tokenmill.attention import PendingRotary
from tokenmill.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Long wavelengths are slowed by ``factor``, short ones kept, the band between interpolated."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates ``q`` and ``k`` (``[T, heads, head_dim]``) by their token positions."""

    def __init__(self, rotary_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(rope, rotary_dim)
        )
        # float32 whatever the model dtype; cast at use, as the reference implementation does.
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self.use_triton = False
        self.pdl = False  # launch the kernel programmatically dependent (tokenmill.kernels.launch)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``query`` and ``key``; the fused path rotates them in place and returns them."""
        if self.use_triton and self.rotary_dim == query.shape[-1]:
            from tokenmill.kernels.rotary import apply_rotary_

            apply_rotary_(positions, query, key, self.cos_sin_cache, self.pdl)
            return query, key
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def pending(self, positions: torch.Tensor, head_dim: int) -> PendingRotary:
        """This rotation by ``positions``, for the attention backend to apply or fuse (heads of
        ``head_dim``: a kernel can take the table only when it rotates the whole head)."""
        table = self.cos_sin_cache if self.rotary_dim == head_dim else None
        return PendingRotary(positions, functools.partial(self.forward, positions), table)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
