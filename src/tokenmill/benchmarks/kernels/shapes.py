"""The model shape the kernel benchmark runs at (Llama-3.2-1B), its size presets, and seeded inputs."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """Llama-3.2-1B by default."""

    hidden: int = 2048
    intermediate: int = 8192
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    block_size: int = 16
    eps: float = 1e-5


@dataclass(frozen=True)
class Sizes:
    tokens: tuple[int, ...]  # rows for the elementwise kernels
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_len: int
    mixed: tuple[int, int, int]  # prefill chunk, decode sequences, their context


FULL = Sizes((1, 256, 4096), (1, 8, 64, 256), (128, 1024, 8192), 2048, (512, 64, 2048))
QUICK = Sizes((1, 4096), (1, 64), (128, 8192), 2048, (512, 64, 2048))
SMOKE = Sizes((1, 5), (1, 3), (40, 100), 48, (20, 3, 40))


def element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def seeded_randn(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
