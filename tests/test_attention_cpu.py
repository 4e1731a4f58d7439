"""The CPU backend's C decode step against the PyTorch reference backend: the same outputs (float32
rounding), the same keys and values stored in the pool bit for bit, with grouped-query heads, sliding
windows, rotary on and off (and one without a table: PyTorch applies it first), skipped slots, block
tables that scatter the contexts, and several new tokens per sequence (speculative verification); steps
it does not take go to the reference unchanged."""

import pytest
import torch

from tokenmill.attention import AttentionMetadata, KVCacheLayer, PendingRotary
from tokenmill.attention.backend import AttentionLayer
from tokenmill.attention.cpu_backend import C_MAX_QUERY_LEN, CpuAttentionBackend
from tokenmill.attention.cpu_kernel import load_decode_attention
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.models.config import RopeConfig
from tokenmill.models.layers.rotary import RotaryEmbedding

LIBRARY = load_decode_attention()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="no C compiler to build the kernel")
BLOCK = 4


def _step(seq_lens: list[int], num_kv_heads: int, head_dim: int, seed: int, skip_row: int | None = None):  # type: ignore[no-untyped-def]
    """A decode step of ``len(seq_lens)`` sequences over a pool whose blocks are handed out shuffled."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(blocks_per_seq) + 3, generator=generator).tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    taken = 0
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = torch.tensor(order[taken : taken + count])
        taken += count
    num_blocks = len(order)
    pool = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=generator)
    positions = torch.tensor([n - 1 for n in seq_lens])
    slots = torch.stack([tables[b, p // BLOCK].long() * BLOCK + p % BLOCK for b, p in enumerate(positions)])
    if skip_row is not None:
        slots[skip_row] = -1
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        slot_mapping=slots,
        block_tables=tables,
    )
    return pool, positions, metadata, generator


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window", "rotary_dim"),
    [(9, 3, 64, None, 64), (4, 4, 32, None, None), (8, 2, 16, 5, 16), (6, 1, 64, 3, 0)],
)
@pytest.mark.parametrize("skip_row", [None, 1])
def test_decode_step_matches_the_reference(
    heads: int, kv_heads: int, head_dim: int, window: int | None, rotary_dim: int | None, skip_row: int | None
) -> None:
    seq_lens = [1, 7, 13, 30]
    pool, positions, metadata, generator = _step(
        seq_lens, kv_heads, head_dim, seed=heads + head_dim, skip_row=skip_row
    )
    layer = AttentionLayer(0, heads, kv_heads, head_dim, head_dim**-0.5, window)
    rows = len(seq_lens)
    # q | k | v as the views of one fused projection, as the models hand them over
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(rows, -1, head_dim) for t in (q, k, v))
    rotary = None
    if rotary_dim:
        embedding = RotaryEmbedding(rotary_dim, 64, RopeConfig(theta=10000.0))
        rotary = embedding.pending(positions, head_dim)
    elif rotary_dim == 0:  # a rotation with no table for a kernel: PyTorch applies it first
        rotary = PendingRotary(positions, lambda a, b: (a * 2.0, b * 0.5), None)
    caches = [KVCacheLayer(pool[0].clone(), pool[1].clone()) for _ in range(2)]
    expected = TorchAttentionBackend().forward(
        layer, q.clone(), k.clone(), v.clone(), metadata, caches[0], rotary
    )
    metadata.derived.clear()
    assert LIBRARY is not None
    got = CpuAttentionBackend(LIBRARY).forward(layer, q, k, v, metadata, caches[1], rotary)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[1].key, caches[0].key) and torch.equal(caches[1].value, caches[0].value)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 80)])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("vectorized", [True, False])
def test_long_contexts_split_into_spans_match_the_reference(
    heads: int, kv_heads: int, head_dim: int, window: int | None, vectorized: bool
) -> None:
    """Contexts cut into several 64-position spans attended apart and merged (at, around and far past a
    span's end; a window that starts inside a span), with head sizes of one and of 1.25 column blocks;
    the AVX2 loops and the portable ones (built without AVX2)."""
    library = load_decode_attention(vectorized)
    if library is None:
        pytest.skip("this compiler cannot build the kernel without AVX2")
    seq_lens = [1, 64, 65, 129, 300]
    pool, positions, metadata, generator = _step(seq_lens, kv_heads, head_dim, seed=heads + head_dim)
    layer = AttentionLayer(0, heads, kv_heads, head_dim, head_dim**-0.5, window)
    rows = len(seq_lens)
    q, k, v = (torch.randn(rows, h, head_dim, generator=generator) for h in (heads, kv_heads, kv_heads))
    rotary = RotaryEmbedding(head_dim, 512, RopeConfig(theta=10000.0)).pending(positions, head_dim)
    caches = [KVCacheLayer(pool[0].clone(), pool[1].clone()) for _ in range(2)]
    expected = TorchAttentionBackend().forward(
        layer, q.clone(), k.clone(), v.clone(), metadata, caches[0], rotary
    )
    metadata.derived.clear()
    got = CpuAttentionBackend(library).forward(layer, q, k, v, metadata, caches[1], rotary)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[1].key, caches[0].key) and torch.equal(caches[1].value, caches[0].value)


def _chunk_step(new_tokens: list[int], contexts: list[int], seed: int):  # type: ignore[no-untyped-def]
    """A step where sequence b brings ``new_tokens[b]`` tokens after ``contexts[b]`` cached ones, its blocks
    handed out shuffled."""
    generator = torch.Generator().manual_seed(seed)
    totals = [n + c for n, c in zip(new_tokens, contexts, strict=True)]
    blocks_per_seq = [-(-n // BLOCK) for n in totals]
    order = torch.randperm(sum(blocks_per_seq) + 2, generator=generator).tolist()
    tables = torch.zeros(len(totals), max(blocks_per_seq), dtype=torch.int32)
    taken = 0
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = torch.tensor(order[taken : taken + count])
        taken += count
    positions = torch.cat([torch.arange(c, c + n) for n, c in zip(new_tokens, contexts, strict=True)])
    sequence = torch.repeat_interleave(torch.arange(len(totals)), torch.tensor(new_tokens))
    slots = tables[sequence, positions // BLOCK].long() * BLOCK + positions % BLOCK
    starts = torch.zeros(len(totals) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(new_tokens), 0)
    metadata = AttentionMetadata(
        query_start_loc=starts,
        seq_lens=torch.tensor(totals, dtype=torch.int32),
        max_query_len=max(new_tokens),
        max_seq_len=max(totals),
        slot_mapping=slots,
        block_tables=tables,
    )
    pool = torch.randn(2, len(order), BLOCK, 2, 16, generator=generator)
    return pool, positions, metadata, generator


def _both_backends(new_tokens: list[int], contexts: list[int], window: int | None = None):  # type: ignore[no-untyped-def]
    pool, positions, metadata, generator = _chunk_step(new_tokens, contexts, seed=sum(new_tokens))
    layer = AttentionLayer(0, 4, 2, 16, 0.25, window)
    rows = len(positions)
    q, k, v = (torch.randn(rows, h, 16, generator=generator) for h in (4, 2, 2))
    rotary = RotaryEmbedding(16, 64, RopeConfig(theta=10000.0)).pending(positions, 16)
    caches = [KVCacheLayer(pool[0].clone(), pool[1].clone()) for _ in range(2)]
    expected = TorchAttentionBackend().forward(
        layer, q.clone(), k.clone(), v.clone(), metadata, caches[0], rotary
    )
    metadata.derived.clear()
    assert LIBRARY is not None
    got = CpuAttentionBackend(LIBRARY).forward(layer, q, k, v, metadata, caches[1], rotary)
    return got, expected, caches


@pytest.mark.parametrize("window", [None, 6])
def test_several_new_tokens_per_sequence_attend_causally_as_the_reference(window: int | None) -> None:
    """Speculative verification steps (1 + k tokens after a context) and short chunks, beside a one-token
    decode: each row attends up to its own position, the new keys and values stored bit for bit."""
    got, expected, caches = _both_backends([5, 1, 13, 3], [9, 14, 0, 22], window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[1].key, caches[0].key) and torch.equal(caches[1].value, caches[0].value)


def test_steps_it_does_not_take_go_to_the_reference() -> None:
    """A prefill chunk longer than ``C_MAX_QUERY_LEN`` takes the PyTorch path, with the same result."""
    got, expected, _ = _both_backends([C_MAX_QUERY_LEN + 1, 1], [3, 7])
    assert torch.equal(got, expected)
