"""The elementwise kernels (RMSNorm, add + RMSNorm, rotary, SiLU-and-mul, KV write) against the PyTorch
code they replace."""

import torch

from tokenmill.attention import KVCacheLayer
from tokenmill.attention.torch_backend import write_kv_cache
from tokenmill.benchmarks.kernels.cases import Case, Outputs
from tokenmill.benchmarks.kernels.shapes import ModelShape, Sizes, element_size, seeded_randn
from tokenmill.models.config import RopeConfig
from tokenmill.models.layers.activation import SiluAndMul
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding


def elementwise_cases(
    shape: ModelShape, sizes: Sizes, dtype: torch.dtype, device: torch.device
) -> list[Case]:
    builders = (rms_norm_case, add_rms_norm_case, rotary_case, silu_and_mul_case, write_kv_case)
    return [build(shape, tokens, dtype, device) for tokens in sizes.tokens for build in builders]


def _norm_layer(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    norm = RMSNorm(shape.hidden, shape.eps).to(device=device, dtype=dtype)
    norm.weight.data.normal_(1.0, 0.1)
    return norm


def rms_norm_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.rmsnorm import rms_norm

    norm = _norm_layer(shape, dtype, device)
    return Case(
        "rms_norm",
        f"T={tokens} x {shape.hidden}",
        lambda: seeded_randn((tokens, shape.hidden), dtype, device),
        lambda x: rms_norm(x, norm.weight, norm.eps),
        lambda x: norm(x),
        2 * tokens * shape.hidden * element_size(dtype),
    )


def add_rms_norm_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.rmsnorm import add_rms_norm

    norm = _norm_layer(shape, dtype, device)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        rows = (tokens, shape.hidden)
        return seeded_randn(rows, dtype, device, 1), seeded_randn(rows, dtype, device, 2)

    return Case(
        "add_rms_norm",
        f"T={tokens} x {shape.hidden}",
        inputs,
        lambda xr: add_rms_norm(xr[0], xr[1], norm.weight, norm.eps),
        lambda xr: norm(xr[0], xr[1]),
        4 * tokens * shape.hidden * element_size(dtype),
    )


def rotary_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.rotary import apply_rotary_

    rope = RotaryEmbedding(shape.head_dim, 8192, RopeConfig(theta=500000.0)).to(device)
    heads = shape.heads + shape.kv_heads

    def triton_fn(inputs: tuple[torch.Tensor, ...]) -> Outputs:
        positions, query, key = inputs
        apply_rotary_(positions, query, key, rope.cos_sin_cache)
        return query, key

    return Case(
        "rotary (q+k)",
        f"T={tokens} x {shape.heads}+{shape.kv_heads} heads x {shape.head_dim}",
        lambda: _rotary_inputs(shape, tokens, dtype, device),
        triton_fn,
        lambda inputs: rope(*inputs),
        2 * tokens * heads * shape.head_dim * element_size(dtype) + tokens * shape.head_dim * 4,
    )


def silu_and_mul_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.activation import silu_and_mul

    return Case(
        "silu_and_mul",
        f"T={tokens} x 2*{shape.intermediate}",
        lambda: seeded_randn((tokens, 2 * shape.intermediate), dtype, device),
        silu_and_mul,
        SiluAndMul(),
        3 * tokens * shape.intermediate * element_size(dtype),
    )


def write_kv_case(shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device) -> Case:
    from tokenmill.kernels.kv_write import write_kv

    def triton_fn(inputs: tuple[torch.Tensor, ...]) -> Outputs:
        key, value, k_pool, v_pool, slots = inputs
        write_kv(key, value, k_pool, v_pool, slots)
        return k_pool, v_pool

    def reference_fn(inputs: tuple[torch.Tensor, ...]) -> Outputs:
        key, value, k_pool, v_pool, slots = inputs
        write_kv_cache(KVCacheLayer(k_pool, v_pool), key, value, slots)
        return k_pool, v_pool

    return Case(
        "write_kv",
        f"T={tokens} x {shape.kv_heads} x {shape.head_dim}",
        lambda: _kv_write_inputs(tokens, shape, dtype, device),
        triton_fn,
        reference_fn,
        4 * tokens * shape.kv_heads * shape.head_dim * element_size(dtype),
    )


def _rotary_inputs(
    shape: ModelShape, tokens: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, and query and key as strided views of one fused QKV output."""
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv = seeded_randn((tokens, q_width + 2 * kv_width), dtype, device)
    query = qkv[:, :q_width].view(tokens, shape.heads, shape.head_dim)
    key = qkv[:, q_width : q_width + kv_width].view(tokens, shape.kv_heads, shape.head_dim)
    positions = torch.arange(tokens, device=device) % 8192
    return positions, query, key


def _kv_write_inputs(
    tokens: int, shape: ModelShape, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    num_blocks = tokens // shape.block_size + 16
    pool = torch.zeros(
        num_blocks, shape.block_size, shape.kv_heads, shape.head_dim, dtype=dtype, device=device
    )
    generator = torch.Generator(device=device).manual_seed(0)
    slots = torch.randperm(num_blocks * shape.block_size, generator=generator, device=device)[:tokens]
    kv = seeded_randn((tokens, 2, shape.kv_heads, shape.head_dim), dtype, device)
    return kv[:, 0], kv[:, 1], pool, pool.clone(), slots
