"""The Triton kernels against their PyTorch references, on random inputs of many shapes.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below before triton is
first imported) on tiny float32 CPU tensors (the interpreter's ``tl.dot`` multiplies bfloat16 operands
as raw bits: triton-lang/triton#11584, not supported there); with CUDA they are compiled and also tested
in bfloat16 and float16, where attention is judged by its error against a float64 reference, relative
to the error of the PyTorch reference at the same precision. The module is skipped when triton is not
installed.
"""

import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import tokenmill.kernels._common as kernel_helpers
from tokenmill.attention import (
    AttentionLayer,
    AttentionMetadata,
    KVCacheLayer,
    PendingRotary,
    TorchAttentionBackend,
)
from tokenmill.attention.torch_backend import write_kv_cache
from tokenmill.kernels import interpreter_enabled, triton_available

if not triton_available():
    pytest.skip("triton cannot run here (no CUDA, TRITON_INTERPRET unset)", allow_module_level=True)

from tokenmill.attention.triton_backend import TritonAttentionBackend
from tokenmill.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from tokenmill.kernels.attention import DecodeConfig, PrefillConfig
from tokenmill.kernels.gemv import GemvConfig, gated_gemv, gemv, rms_norm_gemv
from tokenmill.kernels.kv_write import write_kv
from tokenmill.kernels.rmsnorm import add_rms_norm, head_rms_norm_, rms_norm
from tokenmill.kernels.rotary import apply_rotary_
from tokenmill.models.config import RopeConfig
from tokenmill.models.layers.activation import GeluTanhAndMul, SiluAndMul
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding

ON_CUDA = torch.cuda.is_available() and not interpreter_enabled()
DEVICES = ["cuda"] if ON_CUDA else ["cpu"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if ON_CUDA else [torch.float32]
# Relative error (Frobenius) that attention may always have, whatever the reference's own error.
# Rotated keys (|k| up to ~4): half a unit in the last place of a product, or one of the result.
ROTATED_KEY_TOLERANCE = {
    torch.float32: {"rtol": 2**-22, "atol": 2**-21},
    torch.bfloat16: {"rtol": 2**-7, "atol": 2**-6},
    torch.float16: {"rtol": 2**-10, "atol": 2**-9},
}
ERROR_FLOOR = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
GQA_SHAPES = [(4, 4), (4, 2), (8, 2), (8, 1)]  # query heads per KV head: 1, 2, 4, 8
HEAD_DIMS = [64, 128, 256]
# Attention: every GQA ratio x head dim x window at the main dtype; on CUDA also a few shapes in the
# other dtypes (same code, other tiles), which keeps the number of kernels to compile reasonable.
MAIN_DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
OTHER_DTYPES = [torch.float32, torch.float16] if ON_CUDA else []
# Tiny tiles make the interpreter cover split partitions, unmasked key tiles and many query tiles.
SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
SMALL_DECODE = DecodeConfig(block_n=16, num_warps=4, num_stages=1)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    dtype: torch.dtype = request.param
    return dtype


def assert_matches_layer(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The kernels round where the layers do, but their float32 sums and transcendentals (and the GPU's
    fused multiply-adds) may differ in the last bit. Where terms cancel (rotary's x1*cos - x2*sin) that
    last bit is one ulp of the *operands*, so half-precision results get an absolute tolerance of one
    ulp of the largest value."""
    if expected.dtype in (torch.float16, torch.bfloat16):
        ulp_of_largest = torch.finfo(expected.dtype).eps * float(expected.abs().max())
        rtol = 2e-3 if expected.dtype == torch.float16 else 1.6e-2
        torch.testing.assert_close(out, expected, rtol=rtol, atol=ulp_of_largest)
    else:
        torch.testing.assert_close(out, expected)


def test_triton_available_here() -> None:
    assert triton_available("cuda" if ON_CUDA else "cpu")


# -- elementwise kernels -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 16), (5, 96), (3, 4, 64), (2, 1000)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm(device: str, dtype: torch.dtype, shape: tuple[int, ...], unit_offset: bool) -> None:
    torch.manual_seed(0)
    norm = _rms_norm_layer(shape[-1], unit_offset, dtype, device)
    x = torch.randn(shape, dtype=dtype, device=device)
    assert_matches_layer(rms_norm(x, norm.weight, norm.eps, unit_offset), norm(x))


@pytest.mark.parametrize("shape", [(1, 16), (5, 96), (2, 1000)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm(device: str, dtype: torch.dtype, shape: tuple[int, ...], unit_offset: bool) -> None:
    torch.manual_seed(1)
    norm = _rms_norm_layer(shape[-1], unit_offset, dtype, device)
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device)
    expected_normed, expected_residual = norm(x, residual)
    normed, new_residual = add_rms_norm(x, residual, norm.weight, norm.eps, unit_offset)
    assert new_residual is residual  # updated in place
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    assert_matches_layer(normed, expected_normed)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 24), (2, 2, 64)])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_head_rms_norm_in_place_in_fused_qkv(
    device: str,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    num_tokens: int,
    unit_offset: bool,
) -> None:
    """Each query and key head of a [T, q | k | v] projection normalized where it lies (the row stride is
    the whole projection's, wider still when qkv is itself a view); v and the padding are untouched."""
    torch.manual_seed(2)
    q_norm = _rms_norm_layer(head_dim, unit_offset, dtype, device)
    k_norm = _rms_norm_layer(head_dim, unit_offset, dtype, device)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    wide = torch.randn(num_tokens, q_size + 2 * kv_size + 8, dtype=dtype, device=device)
    qkv = wide[:, : q_size + 2 * kv_size]
    before = wide.clone()
    q, k, _ = before[:, : q_size + 2 * kv_size].split([q_size, kv_size, kv_size], dim=-1)
    expected_q = q_norm(q.reshape(-1, head_dim)).view(q.shape)
    expected_k = k_norm(k.reshape(-1, head_dim)).view(k.shape)
    head_rms_norm_(qkv, heads, kv_heads, head_dim, q_norm.weight, k_norm.weight, q_norm.eps, unit_offset)
    assert_matches_layer(qkv[:, :q_size], expected_q)
    assert_matches_layer(qkv[:, q_size : q_size + kv_size], expected_k)
    assert torch.equal(wide[:, q_size + kv_size :], before[:, q_size + kv_size :])


def test_head_rms_norm_refuses_a_misfit() -> None:
    qkv = torch.zeros(2, 40)
    weight = torch.ones(16)
    with pytest.raises(ValueError, match="does not hold 2 \\+ 1 heads of 16"):
        head_rms_norm_(qkv, 2, 1, 16, weight, weight, 1e-6)
    with pytest.raises(ValueError, match="k_weight shape \\[8\\]"):
        head_rms_norm_(torch.zeros(2, 48), 2, 1, 16, weight, torch.ones(8), 1e-6)


def _rms_norm_layer(dim: int, unit_offset: bool, dtype: torch.dtype, device: str) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, unit_offset).to(device=device, dtype=dtype)
    norm.weight.data.normal_(1.0 if not unit_offset else 0.0, 0.3)
    return norm


@pytest.mark.parametrize(("heads", "kv_heads"), GQA_SHAPES[1:])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rotary_on_fused_qkv_views(
    device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, num_tokens: int
) -> None:
    torch.manual_seed(2)
    rope = RotaryEmbedding(head_dim, 4096, RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0))
    rope = rope.to(device)
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    query = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    value_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    expected_query, expected_key = rope(positions, query.clone(), key.clone())
    apply_rotary_(positions, query, key, rope.cos_sin_cache)
    assert_matches_layer(query, expected_query)
    assert_matches_layer(key, expected_key)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], value_before)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (8, 1, 128)])
def test_rotate_and_write_kv_equals_rotating_then_writing(
    device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """The one-launch rotary and K/V write leaves q, k and both pools exactly as ``apply_rotary_`` then
    ``write_kv`` do, views of a fused QKV output and padding slots (-1) included."""
    from tokenmill.kernels.rotary import rotate_and_write_kv

    torch.manual_seed(4)
    num_tokens, block_size = 9, 4
    rope = RotaryEmbedding(head_dim, 512, RopeConfig(theta=10000.0)).to(device)
    positions = torch.randint(0, 512, (num_tokens,), device=device)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    slots = torch.randperm(6 * block_size, device=device)[:num_tokens]
    slots[[2, 7]] = -1
    pool_shape = (6, block_size, kv_heads, head_dim)
    pools = [torch.randn(pool_shape, dtype=dtype, device=device) for _ in range(2)]

    def split(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query = fused[:, : heads * head_dim].view(num_tokens, heads, head_dim)
        key = fused[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
        return query, key, fused[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)

    expected_qkv, expected_pools = qkv.clone(), [pool.clone() for pool in pools]
    query, key, value = split(expected_qkv)
    apply_rotary_(positions, query, key, rope.cos_sin_cache)
    write_kv(key, value, *expected_pools, slots)
    query, key, value = split(qkv)
    rotate_and_write_kv(positions, query, key, value, rope.cos_sin_cache, (pools[0], pools[1]), slots)
    assert torch.equal(qkv, expected_qkv)
    assert torch.equal(pools[0], expected_pools[0]) and torch.equal(pools[1], expected_pools[1])


@pytest.mark.parametrize("shape", [(1, 32), (5, 2000), (3, 2, 3000)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter's sigmoid
def test_gated_activation(device: str, dtype: torch.dtype, shape: tuple[int, ...], activation: str) -> None:
    torch.manual_seed(3)
    x = 3 * torch.randn(shape, dtype=dtype, device=device)
    kernel, layer = (
        (silu_and_mul, SiluAndMul()) if activation == "silu" else (gelu_tanh_and_mul, GeluTanhAndMul())
    )
    assert_matches_layer(kernel(x), layer(x))


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 64), (2, 128), (3, 256)])
def test_write_kv_skips_negative_slots(
    device: str, dtype: torch.dtype, block_size: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(4)
    pool_shape = (6, block_size, kv_heads, head_dim)
    k_pool, v_pool = (torch.randn(pool_shape, dtype=dtype, device=device) for _ in range(2))
    expected = KVCacheLayer(k_pool.clone(), v_pool.clone())
    slots = torch.randperm(6 * block_size, device=device)[:9]
    slots[[1, 5]] = -1
    fused = torch.randn(9, 2, kv_heads, head_dim, dtype=dtype, device=device)  # strided K and V views
    key, value = fused[:, 0], fused[:, 1]
    write_kv(key, value, k_pool, v_pool, slots)
    write_kv_cache(expected, key, value, slots)
    assert torch.equal(k_pool, expected.key)
    assert torch.equal(v_pool, expected.value)


# -- small-batch projections (EngineConfig.fused_gemv) -------------------------------------------------

# (rows, out features, in features): partial row blocks, in features not a multiple of the K block; one
# row (the CUDA-core kernel), and 2-32 rows (small batches, speculative verification: the tensor cores).
GEMV_SHAPES = [(1, 40, 96), (1, 33, 200), (1, 8, 64), (1, 130, 1000), (2, 40, 96), (7, 33, 200), (32, 8, 64)]
SMALL_GEMV = GemvConfig(block_n=8, block_k=32, num_warps=4, num_stages=1)


def assert_projection_close(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    exact_x: torch.Tensor | None = None,
) -> None:
    """``out`` against ``F.linear`` of the transformed input ``x``, judged like attention: its error
    against a float64 product (of ``exact_x``, the input before rounding, if given) at most twice
    PyTorch's own (or the dtype's floor)."""
    expected = torch.nn.functional.linear(x, weight, bias)
    exact = torch.nn.functional.linear(
        (exact_x if exact_x is not None else x).double(),
        weight.double(),
        bias.double() if bias is not None else None,
    )
    assert out.shape == expected.shape and out.dtype == expected.dtype
    error, reference_error = _relative_error(out, exact), _relative_error(expected, exact)
    assert error <= max(2 * reference_error, ERROR_FLOOR[x.dtype]), (error, reference_error)


def _projection(shape: tuple[int, int, int], dtype: torch.dtype, device: str, bias: bool, in_scale: int = 1):
    rows, out_features, in_features = shape
    x = torch.randn(rows, in_scale * in_features, dtype=dtype, device=device)
    weight = torch.randn(out_features, in_features, dtype=dtype, device=device) / in_features**0.5
    return x, weight, (torch.randn(out_features, dtype=dtype, device=device) if bias else None)


@pytest.mark.parametrize("shape", GEMV_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [None, SMALL_GEMV], ids=["default", "small"])
def test_gemv(device: str, dtype: torch.dtype, shape: tuple[int, int, int], bias: bool, config) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(5)
    x, weight, b = _projection(shape, dtype, device, bias)
    assert_projection_close(gemv(x, weight, b, config), x, weight, b)


@pytest.mark.parametrize("shape", GEMV_SHAPES)
def test_gemv_writes_float32_without_rounding_to_the_input_dtype(
    device: str, dtype: torch.dtype, shape: tuple[int, int, int]
) -> None:
    """The LM head's path: half-precision weights, float32 logits (the float32 sum, not rounded first)."""
    torch.manual_seed(6)
    x, weight, _ = _projection(shape, dtype, device, bias=False)
    out = gemv(x, weight, out_dtype=torch.float32)
    expected = torch.nn.functional.linear(x.double(), weight.double())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", GEMV_SHAPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gemv(
    device: str, dtype: torch.dtype, shape: tuple[int, int, int], unit_offset: bool, with_residual: bool
) -> None:
    """The projection of the RMSNorm layer's output, and the residual stream it would hand on."""
    torch.manual_seed(6)
    x, weight, bias = _projection(shape, dtype, device, bias=shape[1] == 33)
    norm = _rms_norm_layer(x.shape[-1], unit_offset, dtype, device)
    residual = torch.randn_like(x) if with_residual else None
    residual_before = residual.clone() if residual is not None else None
    if residual is None:
        normed, expected_residual = norm(x), x
    else:
        normed, expected_residual = norm(x, residual)
    out, new_residual = rms_norm_gemv(
        x,
        weight,
        norm.weight,
        norm.eps,
        residual,
        unit_offset,
        bias,
        SMALL_GEMV if shape[2] == 1000 else None,
    )
    assert torch.equal(new_residual, expected_residual)
    if residual is not None:
        assert torch.equal(residual, residual_before)  # out of place: other programs still read it
    # The kernel applies 1/rms after the product, so its input is the unrounded normalized row.
    stream = expected_residual.double()
    scale = norm.weight.double() + (1.0 if unit_offset else 0.0)
    exact = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + norm.eps) * scale
    assert_projection_close(out, normed, weight, bias, exact)


@pytest.mark.parametrize("shape", GEMV_SHAPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter's sigmoid
def test_gated_gemv(device: str, dtype: torch.dtype, shape: tuple[int, int, int], activation: str) -> None:
    torch.manual_seed(7)
    gate_up, weight, bias = _projection(shape, dtype, device, bias=shape[1] == 8, in_scale=2)
    layer = SiluAndMul() if activation == "silu" else GeluTanhAndMul()
    out = gated_gemv(gate_up, weight, activation, bias, SMALL_GEMV if shape[2] == 200 else None)
    assert_projection_close(out, layer(gate_up), weight, bias)


def test_gemv_refuses_what_it_cannot_take(device: str) -> None:
    x = torch.randn(33, 16, device=device)
    with pytest.raises(ValueError, match="at most 32 rows"):
        gemv(x, torch.randn(8, 16, device=device))
    with pytest.raises(ValueError, match="does not fit"):
        gemv(x[:1], torch.randn(8, 15, device=device))
    with pytest.raises(ValueError, match="unknown gated activation"):
        gated_gemv(x[:1], torch.randn(8, 8, device=device), "relu")


# -- attention -----------------------------------------------------------------------------------------


@dataclass
class PagedBatch:
    """New tokens' Q/K/V and a cache holding every sequence's earlier context."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cache: KVCacheLayer
    starts: list[int]
    seq_lens: list[int]
    slots: list[int]
    tables: list[list[int]]

    def metadata(self) -> AttentionMetadata:
        """With the launch order the step builder gives (longest context first; decode launches of more
        than one wave follow it)."""
        device = self.query.device
        width = max(len(t) for t in self.tables)
        order = sorted(range(len(self.seq_lens)), key=lambda row: -self.seq_lens[row])
        return AttentionMetadata(
            query_start_loc=torch.tensor(self.starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            max_query_len=max(b - a for a, b in zip(self.starts, self.starts[1:], strict=False)),
            max_seq_len=max(self.seq_lens),
            slot_mapping=torch.tensor(self.slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32, device=device
            ),
            seq_order=torch.tensor(order, dtype=torch.int32, device=device),
        )

    def cache_copy(self, dtype: torch.dtype | None = None) -> KVCacheLayer:
        return KVCacheLayer(self.cache.key.clone().to(dtype), self.cache.value.clone().to(dtype))


def random_batch(
    seed: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    mode: str,
    dtype: torch.dtype,
    device: str,
    block_size: int = 16,
    max_len: int = 60,
    batch: int | None = None,
    shapes: list[tuple[int, int]] | None = None,
) -> PagedBatch:
    """``mode``: "decode" (one new token each) or "mixed" (whole prefills, chunks and decodes);
    ``shapes``: each sequence's (length, new tokens) instead of random ones."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_seqs = batch or rng.randint(1, 4)
    seq_lens = [rng.randint(1, max_len) for _ in range(num_seqs)]
    if shapes is not None:
        seq_lens, query_lens = [n for n, _ in shapes], [q for _, q in shapes]
    elif mode == "decode":
        query_lens = [1] * num_seqs
    else:
        query_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    free = list(range(sum(blocks) + 2))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    pool_shape = (sum(blocks) + 2, block_size, kv_heads, head_dim)
    cache = KVCacheLayer(*(torch.randn(pool_shape, generator=gen).to(device, dtype) for _ in range(2)))
    slots = [
        table[pos // block_size] * block_size + pos % block_size
        for table, s, n in zip(tables, seq_lens, query_lens, strict=True)
        for pos in range(s - n, s)
    ]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    new_tokens = starts[-1]

    def rand(num_heads: int) -> torch.Tensor:
        return torch.randn(new_tokens, num_heads, head_dim, generator=gen).to(device, dtype)

    return PagedBatch(rand(heads), rand(kv_heads), rand(kv_heads), cache, starts, seq_lens, slots, tables)


def check_against_reference(
    batch: PagedBatch,
    layer: AttentionLayer,
    backends: list[TritonAttentionBackend],
    dtype: torch.dtype,
    rotary: RotaryEmbedding | None = None,
) -> None:
    """Each backend's output and cache against the PyTorch backend's, at ``dtype`` and in float64; with
    ``rotary``, q and k are handed over unrotated with the rotation by each token's position."""
    positions = torch.cat(
        [
            torch.arange(n - (b - a), n)
            for n, a, b in zip(batch.seq_lens, batch.starts, batch.starts[1:], strict=False)
        ]
    ).to(batch.query.device)

    def pending(module: RotaryEmbedding | None) -> PendingRotary | None:
        return None if module is None else module.pending(positions, layer.head_dim)

    expected_cache = batch.cache_copy()
    expected = TorchAttentionBackend().forward(
        layer, batch.query, batch.key, batch.value, batch.metadata(), expected_cache, pending(rotary)
    )
    exact = expected.double()
    if dtype != torch.float32:
        exact = TorchAttentionBackend().forward(
            layer,
            batch.query.double(),
            batch.key.double(),
            batch.value.double(),
            batch.metadata(),
            batch.cache_copy(torch.float64),
            pending(rotary),  # the float32 tables are cast to the activations' dtype at use
        )
    for backend in backends:
        cache = batch.cache_copy()
        query, key = batch.query.clone(), batch.key.clone()  # a backend may rotate them in place
        out = backend.forward(layer, query, key, batch.value, batch.metadata(), cache, pending(rotary))
        assert torch.equal(cache.value, expected_cache.value)
        if rotary is None:
            assert torch.equal(cache.key, expected_cache.key)
        else:  # on the GPU the kernel's rotation may round once less (a product fused into the sum)
            torch.testing.assert_close(cache.key, expected_cache.key, **ROTATED_KEY_TOLERANCE[dtype])
        assert_attention_close(out, expected, exact, dtype)


def assert_attention_close(
    out: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype
) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    error, reference_error = _relative_error(out, exact), _relative_error(expected, exact)
    assert error <= max(2 * reference_error, ERROR_FLOOR[dtype]), (error, reference_error)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def _relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return float((value.double() - exact).norm() / exact.norm().clamp_min(1e-30))


def _layer(heads: int, kv_heads: int, head_dim: int, window: int | None) -> AttentionLayer:
    return AttentionLayer(0, heads, kv_heads, head_dim, head_dim**-0.5, window)


AttentionCase = tuple[torch.dtype, int, int, int, int | None]  # dtype, heads, kv heads, head dim, window


def attention_cases(window: int) -> list[AttentionCase]:
    main: list[AttentionCase] = [
        (MAIN_DTYPE, heads, kv_heads, head_dim, w)
        for heads, kv_heads in GQA_SHAPES
        for head_dim in HEAD_DIMS
        for w in (None, window)
    ]
    other: list[AttentionCase] = []
    for dtype in OTHER_DTYPES:
        other += [(dtype, 8, 2, 128, None), (dtype, 4, 4, 64, window), (dtype, 8, 1, 256, None)]
    return main + other


def _case_id(case: AttentionCase) -> str:
    dtype, heads, kv_heads, head_dim, window = case
    return f"{str(dtype).removeprefix('torch.')}-h{heads}/{kv_heads}-d{head_dim}-w{window}"


@pytest.mark.parametrize("case", attention_cases(window=5), ids=_case_id)
def test_paged_attention_mixed_batches(device: str, case: AttentionCase) -> None:
    """Prefills, chunked prefills and decodes in one batch, blocks shuffled across the pool."""
    dtype, heads, kv_heads, head_dim, window = case
    seed = heads * 1000 + kv_heads * 100 + head_dim + (window or 0)
    block_size = 16 if seed % 2 else 5
    batch = random_batch(
        seed,
        heads,
        kv_heads,
        head_dim,
        mode="mixed",
        dtype=dtype,
        device=device,
        block_size=block_size,
        max_len=40,
    )
    backends = [TritonAttentionBackend(), TritonAttentionBackend(prefill_config=SMALL_PREFILL)]
    check_against_reference(batch, _layer(heads, kv_heads, head_dim, window), backends, dtype)


@pytest.mark.parametrize("case", attention_cases(window=7), ids=_case_id)
def test_paged_attention_decode(device: str, case: AttentionCase) -> None:
    """One new token per sequence, in one program per sequence or split over 16-key partitions; the new
    K/V written by the KV-write kernel or by the decode kernel itself, which also applies the rotary
    embedding when it is handed over."""
    dtype, heads, kv_heads, head_dim, window = case
    seed = 7 + heads * 1000 + kv_heads * 100 + head_dim + (window or 0)
    batch = random_batch(seed, heads, kv_heads, head_dim, mode="decode", dtype=dtype, device=device)
    layer = _layer(heads, kv_heads, head_dim, window)
    backends = [
        TritonAttentionBackend(
            fused_decode_rotary_kv=fused, decode_partition_size=partition, decode_config=config
        )
        for fused in (False, True)
        for partition, config in ((None, None), (16, SMALL_DECODE))
    ]
    check_against_reference(batch, layer, backends, dtype)
    rotary = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0)).to(device)
    check_against_reference(batch, layer, backends, dtype, rotary)


@pytest.mark.parametrize("window", [None, 100, 300])
def test_decode_default_split_on_a_long_context(device: str, dtype: torch.dtype, window: int | None) -> None:
    """A few long sequences: the default partitioning splits them (the partials are merged)."""
    batch = random_batch(
        11, 4, 1, 64, mode="decode", dtype=dtype, device=device, max_len=700, batch=2, block_size=16
    )
    backends = [TritonAttentionBackend(), TritonAttentionBackend(fused_decode_rotary_kv=True)]
    rotary = RotaryEmbedding(64, 1024, RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0)).to(device)
    check_against_reference(batch, _layer(4, 1, 64, window), backends, dtype, rotary)


def test_decode_short_contexts_stay_unsplit_in_a_split_launch(device: str, dtype: torch.dtype) -> None:
    """A launch split for its longest context, where the contexts of at most ``DECODE_MAX_UNSPLIT`` keys
    take the one-partition path and the longer ones the merge: both match the reference. A bound within
    ``DECODE_MAX_UNSPLIT`` plans no split at all."""
    from tokenmill.kernels.attention import DECODE_MAX_UNSPLIT, plan_decode_split

    batch = random_batch(39, 4, 1, 64, mode="decode", dtype=dtype, device=device, max_len=600, batch=3)
    assert min(batch.seq_lens) <= DECODE_MAX_UNSPLIT < max(batch.seq_lens)
    split = plan_decode_split(3, 1, max(batch.seq_lens), torch.device(device), 64)
    assert split.num_splits > 1 and split.max_unsplit == DECODE_MAX_UNSPLIT
    assert plan_decode_split(1, 1, DECODE_MAX_UNSPLIT, torch.device(device), 64).num_splits == 1
    backends = [TritonAttentionBackend(), TritonAttentionBackend(fused_decode_rotary_kv=True)]
    rotary = RotaryEmbedding(64, 1024, RopeConfig(theta=10000.0)).to(device)
    check_against_reference(batch, _layer(4, 1, 64, None), backends, dtype, rotary)


def test_decode_of_several_waves_launches_longest_first(device: str, dtype: torch.dtype) -> None:
    """More programs than one wave of the GPU: they are launched longest context first (the metadata's
    ``seq_order``), and each sequence still gets its own output; one wave or a split launch ignores the
    order."""
    from tokenmill.kernels.attention import launch_waves
    from tokenmill.kernels.attention.plan import DECODE_PROGRAMS_PER_SM

    one_wave = DECODE_PROGRAMS_PER_SM * kernel_helpers.sm_count(torch.device(device))
    num_seqs = one_wave // 2 + 2  # two KV heads: a few programs more than one wave, on any GPU
    batch = random_batch(41, 4, 2, 64, mode="decode", dtype=dtype, device=device, max_len=80, batch=num_seqs)
    assert launch_waves(num_seqs * 2, torch.device(device)) > 1
    backends = [TritonAttentionBackend(), TritonAttentionBackend(fused_decode_rotary_kv=True)]
    rotary = RotaryEmbedding(64, 128, RopeConfig(theta=10000.0)).to(device)
    check_against_reference(batch, _layer(4, 2, 64, None), backends, dtype, rotary)


def test_decode_tiles_follow_the_batch_and_the_pool_dtype() -> None:
    """8 warps while each (sequence, KV head) program has an SM to itself; 4 once they share SMs, with a
    third pipeline stage for a float8 pool only (its measured gain; a bfloat16 pool loses with it)."""
    from tokenmill.kernels.attention import default_decode_config

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert default_decode_config(128, bf16, 8, 132, fp8) == DecodeConfig(64, 8, 2)
    assert default_decode_config(128, bf16, 1424, 132, bf16) == DecodeConfig(64, 4, 2)
    assert default_decode_config(128, bf16, 1424, 132, fp8) == DecodeConfig(64, 4, 2, 128)
    assert default_decode_config(256, bf16, 1424, 132) == DecodeConfig(32, 4, 2)


def test_decode_merges_leave_their_counters_at_zero(device: str) -> None:
    """The last partition to arrive merges and resets its counter: launch after launch (layers, graph
    replays) the same inputs give the same output."""
    from tokenmill.kernels.attention import partitions

    batch = random_batch(13, 8, 2, 64, mode="decode", dtype=torch.float32, device=device, max_len=90)
    backend = TritonAttentionBackend(decode_partition_size=16, decode_config=SMALL_DECODE)
    layer = _layer(8, 2, 64, None)
    outputs = [
        backend.forward(layer, batch.query, batch.key, batch.value, batch.metadata(), batch.cache_copy())
        for _ in range(3)
    ]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[1], outputs[2])
    assert not kernel_helpers._ARRIVALS[(partitions.COUNTERS_OWNER, torch.device(outputs[0].device))].any()


@pytest.mark.parametrize("window", [None, 3, 24])
def test_chunked_prefill_over_a_long_context(device: str, dtype: torch.dtype, window: int | None) -> None:
    """Long chunks after long contexts, so query tiles meet unmasked key tiles, diagonals and windows."""
    batch = random_batch(12, 8, 2, 64, mode="mixed", dtype=dtype, device=device, max_len=120, batch=2)
    backends = [TritonAttentionBackend(), TritonAttentionBackend(prefill_config=SMALL_PREFILL)]
    check_against_reference(batch, _layer(8, 2, 64, window), backends, dtype)


def verification_batch(seed: int, dtype: torch.dtype, device: str, context: int) -> PagedBatch:
    """A speculative verification step's shape (a few query tokens after a long context) beside a
    decode and a whole short prompt."""
    shapes = [(context + 9, 9), (context // 2, 1), (7, 7)]
    return random_batch(seed, 8, 2, 64, mode="mixed", dtype=dtype, device=device, shapes=shapes)


@pytest.mark.parametrize("split", [(4, 16, 0), (3, 16, 48)])
def test_split_prefill_matches_the_reference(
    device: str, dtype: torch.dtype, split: tuple[int, int, int]
) -> None:
    """Each query tile's keys cut into ``num_splits`` partitions of at least ``min_partition`` keys
    (contexts of at most ``max_unsplit`` keys whole): rows that see no key of a partition, partitions
    past a tile's keys, tiles of one partition. Same output as the PyTorch backend; the merges leave
    their counters at zero, launch after launch."""
    from tokenmill.kernels.attention import DecodeSplit, paged_prefill_attention, partitions

    layer = _layer(8, 2, 64, None)
    for seed, context in ((0, 90), (1, 40)):
        batch = verification_batch(seed, dtype, device, context)
        metadata = batch.metadata()
        expected = TorchAttentionBackend().forward(
            layer, batch.query, batch.key, batch.value, metadata, batch.cache_copy()
        )
        exact = TorchAttentionBackend().forward(
            layer, batch.query.double(), batch.key.double(), batch.value.double(), metadata,
            batch.cache_copy(torch.float64),
        )  # fmt: skip
        cache = batch.cache_copy()
        assert metadata.slot_mapping is not None and metadata.block_tables is not None
        write_kv(batch.key, batch.value, cache.key, cache.value, metadata.slot_mapping)
        tables, starts, lens = metadata.block_tables, metadata.query_start_loc, metadata.seq_lens
        inputs = (batch.query, cache.key, cache.value, tables, starts, lens, layer.scale, None, SMALL_PREFILL)
        outputs = [paged_prefill_attention(*inputs, split=DecodeSplit(*split)) for _ in range(2)]
        assert torch.equal(outputs[0], outputs[1])
        assert_attention_close(outputs[0], expected, exact, dtype)
        assert not kernel_helpers._ARRIVALS[(partitions.COUNTERS_OWNER, outputs[0].device)].any()


@pytest.mark.parametrize("window", [None, 24])
def test_prefill_rotary_and_kv_write_in_one_launch(
    device: str, dtype: torch.dtype, window: int | None
) -> None:
    """``fused_prefill_rotary_kv``: mixed batches handed unrotated q and k give the PyTorch backend's
    output and cache, with and without split attention."""
    batch = random_batch(21, 8, 2, 64, mode="mixed", dtype=dtype, device=device, max_len=70, batch=3)
    rotary = RotaryEmbedding(64, 1024, RopeConfig(theta=10000.0)).to(device)
    fused = {"fused_prefill_rotary_kv": True}
    backends = [
        TritonAttentionBackend(**fused),
        TritonAttentionBackend(prefill_config=SMALL_PREFILL, split_prefill=True, **fused),
    ]
    check_against_reference(batch, _layer(8, 2, 64, window), backends, dtype, rotary)


def test_short_prefills_split_by_the_plan(device: str, dtype: torch.dtype) -> None:
    """Through the backend (``split_prefill_attention``): a launch of few query tokens over a context
    bound above ``DECODE_MAX_UNSPLIT`` splits, one of more than ``PREFILL_SPLIT_MAX_TOKENS`` tokens or
    with a window does not; the windowed layer and the unsplit launch still match the reference."""
    from tokenmill.kernels.attention import DECODE_MAX_UNSPLIT, plan_prefill_split
    from tokenmill.kernels.attention.plan import PREFILL_SPLIT_MAX_TOKENS

    dev = torch.device(device)
    assert plan_prefill_split(12, 8, DECODE_MAX_UNSPLIT + 100, dev, 16).num_splits > 1
    assert plan_prefill_split(PREFILL_SPLIT_MAX_TOKENS + 1, 8, 4096, dev, 16).num_splits == 1
    assert plan_prefill_split(12, 8, DECODE_MAX_UNSPLIT, dev, 16).num_splits == 1
    assert plan_prefill_split(12, 8, None, dev, 16).num_splits == 1
    batch = verification_batch(7, dtype, device, DECODE_MAX_UNSPLIT + 20)
    backends = [TritonAttentionBackend(prefill_config=SMALL_PREFILL, split_prefill=True)]
    for window in (None, 40):
        check_against_reference(batch, _layer(8, 2, 64, window), backends, dtype)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 128), (8, 1, 256)])
@pytest.mark.parametrize("window", [None, 4])
def test_without_cache_each_sequence_attends_to_itself(
    device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    torch.manual_seed(5)
    lens = [3, 1, 21, 9]
    q, k, v = (
        torch.randn(sum(lens), h, head_dim, device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads)
    )
    layer = _layer(heads, kv_heads, head_dim, window)
    metadata = AttentionMetadata.for_prefill(lens, device)
    expected = TorchAttentionBackend().forward(layer, q, k, v, metadata, None)
    exact = TorchAttentionBackend().forward(layer, q.double(), k.double(), v.double(), metadata, None)
    for backend in (TritonAttentionBackend(), TritonAttentionBackend(prefill_config=SMALL_PREFILL)):
        out = backend.forward(layer, q, k, v, AttentionMetadata.for_prefill(lens, device), None)
        assert_attention_close(out, expected, exact, dtype)


def test_metadata_derived_tiles_are_shared_by_layers(device: str) -> None:
    batch = random_batch(13, 4, 2, 64, mode="mixed", dtype=torch.float32, device=device)
    metadata = batch.metadata()
    layer = _layer(4, 2, 64, None)
    first = TritonAttentionBackend().forward(
        layer, batch.query, batch.key, batch.value, metadata, batch.cache_copy()
    )
    assert len(metadata.derived) == 1
    second = TritonAttentionBackend().forward(
        layer, batch.query, batch.key, batch.value, metadata, batch.cache_copy()
    )
    assert len(metadata.derived) == 1
    assert torch.equal(first, second)


def test_head_dim_must_be_a_power_of_two(device: str) -> None:
    q = torch.randn(2, 2, 80, device=device)
    with pytest.raises(ValueError, match="power-of-two"):
        TritonAttentionBackend().forward(
            _layer(2, 2, 80, None), q, q, q, AttentionMetadata.for_prefill([2]), None
        )


def test_engine_with_triton_attention_matches_the_reference_loop(tiny_llama_folder) -> None:  # type: ignore[no-untyped-def]
    """The engine toggle end to end: paged Triton attention (chunked prefill mixed with decodes) gives
    the greedy tokens of the single-sequence PyTorch loop."""
    from engine_helpers import engine_for, run_to_completion
    from tokenmill import SamplingParams
    from tokenmill.loading import load_model
    from tokenmill.reference import greedy_generate

    device = DEVICES[0]
    loaded = load_model(tiny_llama_folder, device=device, dtype="float32")
    engine = engine_for(
        loaded, device=device, attention_backend="triton", block_size=4, num_kv_blocks=64,
        max_model_len=64, chunked_prefill=True, max_num_batched_tokens=12,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = {"a": list(range(3, 20)), "b": [5, 9, 11], "c": list(range(40, 49))}
    outputs = run_to_completion(engine, {rid: (prompt, params) for rid, prompt in prompts.items()})
    for rid, prompt in prompts.items():
        assert outputs[rid].outputs[0].token_ids == greedy_generate(loaded.model, prompt, 6).token_ids, rid


# -- the model layers on the kernels (EngineConfig.fused_*) --------------------------------------------

KERNEL_TOGGLES = ("rms_norm", "rotary", "activation", "gemv")
# The kernels each toggle switches on, by the functions the layers call.
KERNELS_OF_TOGGLE = {
    "rms_norm": ("tokenmill.kernels.rmsnorm", ("rms_norm", "add_rms_norm")),
    "rotary": ("tokenmill.kernels.rotary", ("apply_rotary_",)),
    "activation": ("tokenmill.kernels.activation", ("silu_and_mul", "gelu_tanh_and_mul")),
    "gemv": ("tokenmill.kernels.gemv", ("gemv", "rms_norm_gemv", "gated_gemv")),
}
# A prefill-sized packing (what the GEMV takes with gemv_rows), and a single token (what it always takes).
PACKINGS = ([5, 1, 9], [1])
# Relative (Frobenius) logit difference between the fused and the PyTorch model: the kernels round where
# the layers do, so only float32 sums in another order differ (and then rounding, at half precision).
MODEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(scope="module", params=["llama3", "qwen3", "gemma3"])
def tiny_model_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Llama (fused residual norms, SwiGLU), Qwen3 (per-head q/k norms), Gemma 3 (1 + w norms, GeGLU)."""
    from tiny_models import save_tiny_model

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny_model(request.param, folder)
    return folder


def packed_logits(model: torch.nn.Module, lens: list[int], device: str) -> torch.Tensor:
    """Logits of every position of a few packed sequences, with the reference attention (no cache)."""
    from tokenmill.attention import ForwardContext, forward_context

    generator = torch.Generator().manual_seed(sum(lens))
    input_ids = torch.randint(3, 300, (sum(lens),), generator=generator).to(device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    metadata = AttentionMetadata.for_prefill(lens, device)
    with torch.inference_mode(), forward_context(ForwardContext(metadata, TorchAttentionBackend())):
        return model.compute_logits(model(input_ids, positions))  # type: ignore[operator]


class KernelCalls:
    """Counts the calls the layers make to each kernel function (monkeypatched wrappers)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import importlib

        self.counts: dict[str, int] = {}
        for toggle, (module_name, names) in KERNELS_OF_TOGGLE.items():
            module = importlib.import_module(module_name)
            for name in names:
                monkeypatch.setattr(module, name, self._counting(toggle, getattr(module, name)))

    def _counting(self, toggle: str, kernel):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.counts[toggle] = self.counts.get(toggle, 0) + 1
            return kernel(*args, **kwargs)

        return wrapper

    def used(self) -> set[str]:
        used, self.counts = set(self.counts), {}
        return used


def test_fused_model_matches_pytorch_and_toggles_are_independent(  # type: ignore[no-untyped-def]
    tiny_model_folder, device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies configured with all kernels on, and each alone: the logits of the PyTorch model every time,
    and exactly the toggled kernels called; the loaded model itself stays plain PyTorch."""
    from tokenmill.kernels.options import KernelOptions
    from tokenmill.loading import load_model

    model = load_model(tiny_model_folder, device=device, dtype=dtype).model
    references = [packed_logits(model, lens, device) for lens in PACKINGS]
    calls = KernelCalls(monkeypatch)
    every = dict.fromkeys(KERNEL_TOGGLES, True) | {"gemv_rows": True}
    settings = [every, {"gemv": True, "gemv_rows": True}] + [{name: True} for name in KERNEL_TOGGLES]
    for setting in settings:
        configured = model.with_kernels(KernelOptions(**setting))
        for lens, reference in zip(PACKINGS, references, strict=True):
            logits = packed_logits(configured, lens, device)
            difference = float((logits - reference).norm() / reference.norm())
            assert difference <= MODEL_TOLERANCE[dtype], (setting, lens, difference)
        assert calls.used() == set(setting) - {"gemv_rows"}, setting  # gemv_rows: the gemv functions
    for lens, reference in zip(PACKINGS, references, strict=True):
        assert torch.equal(packed_logits(model, lens, device), reference)
    assert calls.used() == set()


def test_gemv_rows_takes_small_weights_only_and_no_prologue_above_one_row() -> None:
    """Which inputs a projection sends to the GEMV: one row always (with ``gemv``); 2-32 rows with
    ``gemv_rows`` for weights under ``GEMV_ROWS_MAX_WEIGHTS`` elements, and then without a fused prologue."""
    from tokenmill.kernels.options import GEMV_MAX_ROWS, GEMV_ROWS_MAX_WEIGHTS, KernelOptions
    from tokenmill.models.layers import RowParallelLinear
    from tokenmill.models.layers.linear import gemv_fits

    small, large = RowParallelLinear(64, 32), RowParallelLinear(2048, 2048)
    assert small.weight.numel() < GEMV_ROWS_MAX_WEIGHTS <= large.weight.numel()
    rows = {n: torch.empty(n, 64) for n in (1, 2, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1)}
    small.configure(KernelOptions(gemv=True, gemv_rows=True))
    assert [gemv_fits(x, small) for x in rows.values()] == [True, True, True, False]
    assert [gemv_fits(x, small, prologue=True) for x in rows.values()] == [True, False, False, False]
    large.configure(KernelOptions(gemv=True, gemv_rows=True))
    wide = {n: torch.empty(n, 2048) for n in (1, 2)}
    assert [gemv_fits(x, large) for x in wide.values()] == [True, False]
    small.configure(KernelOptions(gemv=True))
    assert [gemv_fits(x, small) for x in rows.values()] == [True, False, False, False]
    small.configure(KernelOptions(gemv_rows=True))  # gemv_rows without gemv: nothing
    assert not any(gemv_fits(x, small) for x in rows.values())


def test_kernel_options_auto_is_off_on_cpu_and_explicit_on_needs_triton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokenmill.kernels.options import KernelOptions

    assert KernelOptions.resolve("cpu") == KernelOptions()  # auto: never the interpreter
    if interpreter_enabled():
        assert KernelOptions.resolve("cpu", rotary=True).enabled == ("rotary",)
    if ON_CUDA:
        auto_on = (*KERNEL_TOGGLES, "gemv_rows", "w8a8")  # (w8a8 applies to quantized weights only)
        assert KernelOptions.resolve("cuda").enabled == auto_on
        assert KernelOptions.resolve("cuda", activation=False).enabled == tuple(
            name for name in auto_on if name != "activation"
        )
    assert not KernelOptions.resolve("cpu").pdl
    with pytest.raises(ValueError, match="programmatic dependent launch needs compiled Triton"):
        KernelOptions.resolve("cpu", pdl=True)  # the interpreter too: it has no launch to make dependent
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="fused rms_norm kernel needs Triton"):
        KernelOptions.resolve("cpu", rms_norm=True)


def test_engine_with_every_fused_toggle_matches_the_reference_loop(tiny_llama_folder) -> None:  # type: ignore[no-untyped-def]
    """The EngineConfig toggles end to end: fused layers, fused sampling and Triton attention give the
    greedy tokens of the single-sequence PyTorch loop, batched and alone (where the GEMVs run), and a
    seeded sampled request runs through the fused draw."""
    from engine_helpers import engine_for, run_to_completion
    from tokenmill import SamplingParams
    from tokenmill.loading import load_model
    from tokenmill.reference import greedy_generate

    device = DEVICES[0]
    loaded = load_model(tiny_llama_folder, device=device, dtype="float32")
    reference = greedy_generate(loaded.model, [4, 8, 15, 16], 3).token_ids  # plain PyTorch: no kernels yet
    engine = engine_for(
        loaded, device=device, attention_backend="triton", block_size=4, num_kv_blocks=64, max_model_len=64,
        fused_rms_norm=True, fused_rotary=True, fused_activation=True, fused_gemv=True, fused_gemv_rows=True,
        fused_decode_rotary_kv=True, fused_prefill_rotary_kv=True, split_prefill_attention=True,
        fused_sampling=True, fused_w8a8=False,  # (w8a8: quantized weights only; auto-on on a GPU)
    )  # fmt: skip
    assert engine.runner.model.kernel_options.enabled == (*KERNEL_TOGGLES, "gemv_rows")
    assert not loaded.model.kernel_options.enabled, "the engine configures a copy, not the loaded model"
    backend = engine.runner.backend
    assert engine.runner.sampler.fused and backend.fused_decode_rotary_kv
    assert backend.fused_prefill_rotary_kv and backend.split_prefill
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=3, ignore_eos=True)
    outputs = run_to_completion(engine, {"a": ([4, 8, 15, 16], greedy), "b": ([23, 42], seeded)})
    assert outputs["a"].outputs[0].token_ids == reference
    assert len(outputs["b"].outputs[0].token_ids) == 3
    alone = run_to_completion(engine, {"c": ([4, 8, 15, 16], greedy)})  # one-row decode steps: the GEMVs
    assert alone["c"].outputs[0].token_ids == reference
