"""Rotary position embeddings (rotate-half layout), with linear, Llama 3 and YaRN frequency scaling.

Configured with ``KernelOptions.rotary``, ``tokenmill.kernels.rotary`` rotates q and k in place in one
launch, rounding where the PyTorch code below does.
"""

import functools
import math
from collections.abc import Callable

import torch

from tokenmill.attention import PendingRotary
from tokenmill.kernels.options import KernelOptions
from tokenmill.models.config import RopeConfig
from tokenmill.models.layers.fusable import FusableLayer

Pair = tuple[torch.Tensor, torch.Tensor]


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_scaled(inv_freq, rope, rotary_dim)
    return inv_freq  # "default", and "dynamic" (unscaled up to max_position_embeddings)


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


def _yarn_scaled(inv_freq: torch.Tensor, rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """YaRN: frequencies that turn more than ``beta_fast`` times over the original context are kept, those
    that turn fewer than ``beta_slow`` times are divided by ``factor``, and a linear ramp over the
    dimensions between blends the two."""

    def dimension_of(rotations: float) -> float:
        wavelength = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(wavelength) / (2 * math.log(rope.theta))

    low, high = dimension_of(rope.beta_fast), dimension_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    width = high - low if high != low else 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / width).clamp(0, 1)
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding(FusableLayer):
    """Rotates ``q`` and ``k`` (``[T, heads, head_dim]``) by their token positions."""

    def __init__(self, rotary_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(rope, rotary_dim)
        )
        # float32 whatever the model dtype; cast at use, as the reference implementation does. YaRN's
        # attention factor scales the table, so every path that reads it (kernels included) applies it.
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if rope.attention_factor != 1.0:
            table = table * rope.attention_factor
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self.configure(KernelOptions())

    def configure(self, options: KernelOptions) -> None:
        self.pdl = options.pdl  # launch the kernel programmatically dependent (tokenmill.kernels.launch)
        self._rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Pair] = self.forward_torch
        if options.rotary:
            from tokenmill.kernels.rotary import apply_rotary_

            self._apply_rotary_kernel = apply_rotary_
            self._rotate = self.forward_triton

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> Pair:
        """Rotated ``query`` and ``key``; the Triton path rotates them in place and returns them."""
        return self._rotate(positions, query, key)

    def forward_torch(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> Pair:
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def forward_triton(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> Pair:
        """In place, one launch; the kernel rotates whole heads, so partial rotation takes PyTorch."""
        if self.rotary_dim != query.shape[-1]:
            return self.forward_torch(positions, query, key)
        self._apply_rotary_kernel(positions, query, key, self.cos_sin_cache, self.pdl)
        return query, key

    def pending(self, positions: torch.Tensor, head_dim: int) -> PendingRotary:
        """This rotation by ``positions``, for the attention backend to apply or fuse (heads of
        ``head_dim``: a kernel can take the table only when it rotates the whole head)."""
        table = self.cos_sin_cache if self.rotary_dim == head_dim else None
        return PendingRotary(positions, functools.partial(self.forward, positions), table)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
