"""``kv_cache_dtype="fp8"``: the pool stores K/V as float8 e4m3 (scale 1) and attention reads them back.

References written here: the new K/V's bytes in the pool against a conversion to e4m3 done apart, and a
naive attention in float64 over the context as the pool holds it, for the Triton kernels (Triton's
interpreter on CPU) and the PyTorch backend, prefills, chunked prefills and decodes mixed; and the
engine's pool, sizes and refusals.
"""

import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill.attention import AttentionLayer, AttentionMetadata, KVCacheLayer, TorchAttentionBackend
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kernels import triton_available
from tokenmill.sampling_params import SamplingParams

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(seed: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int) -> dict:
    """Sequences with earlier context in a float8 pool (blocks shuffled) and new tokens: whole prefills,
    chunks and single decode tokens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [rng.randint(1, 40) for _ in range(4)]
    query_lens = [1, seq_lens[1], rng.randint(1, seq_lens[2]), 1]
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    free = list(range(sum(blocks) + 2))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    shape = (sum(blocks) + 2, block_size, kv_heads, head_dim)
    pool = [(torch.randn(shape, generator=gen) * 2).to(FP8).to(DEVICE) for _ in range(2)]
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, s, n in zip(tables, seq_lens, query_lens, strict=True)
        for p in range(s - n, s)
    ]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    width = max(map(len, tables))
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE
        ),
    )

    def new(num_heads: int) -> torch.Tensor:
        return torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(DEVICE, dtype)

    return {
        "query": new(heads), "key": new(kv_heads), "value": new(kv_heads), "pool": pool,
        "metadata": metadata, "starts": starts, "seq_lens": seq_lens, "slots": slots, "tables": tables,
        "block_size": block_size,
    }  # fmt: skip


def _naive(batch: dict, layer: AttentionLayer, cache: KVCacheLayer) -> torch.Tensor:
    """Causal attention in float64 over each sequence's context as ``cache`` (a float8 pool) holds it."""
    flat = [pool.float().double().flatten(0, 1).cpu() for pool in (cache.key, cache.value)]
    query = batch["query"].double().cpu()
    out = torch.empty_like(query)
    group = layer.num_heads // layer.num_kv_heads
    bs = batch["block_size"]
    for seq, (start, end) in enumerate(zip(batch["starts"], batch["starts"][1:], strict=False)):
        seq_len, table = batch["seq_lens"][seq], batch["tables"][seq]
        context = torch.tensor([table[p // bs] * bs + p % bs for p in range(seq_len)])
        keys, values = flat[0][context], flat[1][context]  # [L, Hkv, D]
        for row in range(start, end):
            position = seq_len - (end - row)
            for head in range(layer.num_heads):
                k, v = keys[: position + 1, head // group], values[: position + 1, head // group]
                weights = torch.softmax(k @ query[row, head] * layer.scale, dim=0)
                out[row, head] = weights @ v
    return out


def _to_fp8(values: torch.Tensor, backend: object) -> torch.Tensor:
    """``values`` rounded to e4m3 as ``backend`` rounds them: PyTorch's conversion (round to nearest even,
    as the GPU's), except for the Triton kernels in Triton's CPU interpreter, whose own conversion drops
    the carry of a mantissa that rounds up (1.99 becomes 1.0): there, the interpreter's conversion."""
    if type(backend) is TorchAttentionBackend or torch.cuda.is_available():
        return values.to(FP8)
    import triton
    import triton.language as tl

    @triton.jit
    def convert(source: tl.tensor, target: tl.tensor, size: tl.constexpr) -> None:
        offsets = tl.arange(0, size)
        tl.store(target + offsets, tl.load(source + offsets).to(target.dtype.element_ty))

    flat = values.contiguous().flatten()
    size = triton.next_power_of_2(flat.numel())
    padded = torch.zeros(size, dtype=values.dtype)
    padded[: flat.numel()] = flat
    out = torch.empty(size, dtype=FP8)
    convert[(1,)](padded, out, size)
    return out[: flat.numel()].view(values.shape)


def _run(backend: object, batch: dict, layer: AttentionLayer) -> tuple[torch.Tensor, KVCacheLayer]:
    cache = KVCacheLayer(batch["pool"][0].clone(), batch["pool"][1].clone())
    out = backend.forward(  # type: ignore[attr-defined]
        layer, batch["query"], batch["key"], batch["value"], batch["metadata"], cache
    )
    return out, cache


def _backends(dtype: torch.dtype) -> list[object]:
    backends: list[object] = [TorchAttentionBackend()]
    # Triton's interpreter multiplies wrong in a 16-bit tl.dot whose operand was converted from float8
    # (float32 operands are right): there the Triton kernels are checked in float32 only.
    interpreted = not torch.cuda.is_available()
    if triton_available() and not (interpreted and dtype != torch.float32):
        from tokenmill.attention.triton_backend import TritonAttentionBackend

        backends += [TritonAttentionBackend(), TritonAttentionBackend(decode_partition_size=16)]
    return backends


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (2, 1, 64)])
def test_attention_over_a_float8_pool_matches_naive(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    block_size = 16 if heads == 4 else 5
    batch = _batch(heads * 10 + head_dim, heads, kv_heads, head_dim, dtype, block_size)
    layer = AttentionLayer(0, heads, kv_heads, head_dim, head_dim**-0.5, None)
    slots = batch["metadata"].slot_mapping
    for backend in _backends(dtype):
        out, cache = _run(backend, batch, layer)
        assert out.dtype == dtype and cache.key.dtype == FP8
        for pool, new in ((cache.key, batch["key"]), (cache.value, batch["value"])):
            written = pool.flatten(0, 1)[slots].cpu()
            expected_bytes = _to_fp8(new.cpu(), backend).view(torch.uint8)
            assert torch.equal(written.view(torch.uint8), expected_bytes), type(backend).__name__
        expected = _naive(batch, layer, cache)
        tolerance = 2e-5 if dtype == torch.float32 else 3e-2  # the product rounding of bf16 inputs
        error = (out.double().cpu() - expected).abs().max() / expected.abs().max()
        assert error < tolerance, (type(backend).__name__, float(error))


def _engine(kv_cache_dtype: str, **options: object) -> LLMEngine:
    config = EngineConfig().with_options(
        model="smollm2-135m", load_format="dummy", dtype="float32", max_model_len=128, device="cpu",
        kv_cache_dtype=kv_cache_dtype, warm_start=False, cpu_kv_cache_gib=0.01, **options,
    )  # fmt: skip
    return LLMEngine(config)


def test_a_float8_pool_takes_a_quarter_of_float32_bytes_and_four_times_the_tokens() -> None:
    plain, fp8 = _engine("auto"), _engine("fp8")
    assert fp8.kv_cache.bytes_per_token * 4 == plain.kv_cache.bytes_per_token
    assert fp8.kv_cache.manager.capacity_tokens >= 4 * plain.kv_cache.manager.capacity_tokens - 16
    assert fp8.kv_cache.layers is not None and fp8.kv_cache.layers[0].key.dtype == FP8
    # The C decode kernel reads the model's dtype only: auto picks the PyTorch attention on CPU.
    assert fp8.config.kernels.attention_backend in ("torch", "triton")
    assert "float8 e4m3" in fp8.describe_startup() and "float8" not in plain.describe_startup()


def test_engine_outputs_with_a_float8_pool_follow_the_rounded_keys() -> None:
    """The same prompts greedily, K/V in float32 and in e4m3: the logprobs of the tokens chosen stay within
    the rounding of e4m3 (3 mantissa bits) of each other, and the first tokens agree."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    runs = []
    for kind in ("auto", "fp8"):
        engine = _engine(kind)
        engine.add_request("a", list(range(5, 45)), params)
        tokens, logprobs = [], []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.new_token_ids
                logprobs += [entry.logprob for entry in delta.new_logprobs or []]
        runs.append((tokens, logprobs))
    (tokens, logprobs), (fp8_tokens, fp8_logprobs) = runs
    assert tokens[0] == fp8_tokens[0]
    assert abs(logprobs[0] - fp8_logprobs[0]) < 0.25


def test_bad_kv_cache_dtypes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig().with_options(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' needs attention_backend"):
        _engine("fp8", attention_backend="cpu")


@pytest.mark.skipif(not triton_available(), reason="needs Triton (its CPU interpreter off CUDA)")
@pytest.mark.parametrize("query_scale,key_scale", [(1.0, 2.0), (2e4, 1e-3)], ids=["plain", "big-query"])
@pytest.mark.parametrize("partition", [None, 16], ids=["one-pass", "split"])
def test_decode_in_float16_over_a_float8_pool(
    query_scale: float, key_scale: float, partition: int | None
) -> None:
    """bfloat16 queries over a float8 pool, whose tiles the decode kernel reads as e4m3 pairs converted to
    float16 (its default): subnormal codes (values ~0.01), queries beyond float16's range (scaled by a
    power of two), split contexts, and the new token written by the kernel, against float64 attention."""
    from tokenmill.kernels.attention import NewTokens, paged_decode_attention

    gen = torch.Generator().manual_seed(7)
    seq_lens, block_size, heads, kv_heads, head_dim = [5, 37, 70], 16, 8, 2, 64
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    order = torch.randperm(sum(blocks) + 1, generator=gen).tolist()
    tables = [[order.pop() for _ in range(n)] for n in blocks]
    shape = (sum(blocks) + 1, block_size, kv_heads, head_dim)
    key_pool = (torch.randn(shape, generator=gen) * key_scale).to(FP8).to(DEVICE)
    value_pool = (torch.randn(shape, generator=gen) * 0.01).to(FP8).to(DEVICE)
    query = (torch.randn(3, heads, head_dim, generator=gen) * query_scale).to(DEVICE, torch.bfloat16)
    new_key = (torch.randn(3, kv_heads, head_dim, generator=gen) * key_scale).to(DEVICE, torch.bfloat16)
    new_value = torch.randn(3, kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    last = [n - 1 for n in seq_lens]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, last, strict=True)]
    width = max(blocks)
    out = paged_decode_attention(
        query, key_pool, value_pool,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), max(seq_lens), head_dim**-0.5,
        partition_size=partition,
        new_tokens=NewTokens(new_key, new_value, torch.tensor(slots, device=DEVICE)),
    )  # fmt: skip
    for pool, new in ((key_pool, new_key), (value_pool, new_value)):
        written = pool.flatten(0, 1)[slots].cpu().view(torch.uint8)
        assert torch.equal(written, _to_fp8(new.cpu(), None).view(torch.uint8))
    expected = torch.empty(out.shape, dtype=torch.float64)
    flat_k, flat_v = key_pool.flatten(0, 1).cpu().double(), value_pool.flatten(0, 1).cpu().double()
    for seq, (table, seq_len) in enumerate(zip(tables, seq_lens, strict=True)):
        context = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        for head in range(heads):
            k, v = flat_k[context, head // (heads // kv_heads)], flat_v[context, head // (heads // kv_heads)]
            weights = torch.softmax(k @ query[seq, head].cpu().double() * head_dim**-0.5, dim=0)
            expected[seq, head] = weights @ v
    assert torch.isfinite(out).all()
    error = (out.cpu().double() - expected).abs().max() / expected.abs().max()
    assert error < 1e-2, float(error)  # bf16 output, float16 probabilities (~4e-3 measured)
