"""The reference attention backend vs a naive per-sequence, per-head float64 implementation, on random
paged layouts: mixed prefill/decode/chunked-prefill batches, GQA, sliding windows, block boundaries."""

import math
import random

import pytest
import torch

from tokenmill.attention import AttentionLayer, AttentionMetadata, KVCacheLayer, TorchAttentionBackend
from tokenmill.attention.torch_backend import write_kv_cache


def naive_attention(q, keys, values, scale, window, context_len):  # type: ignore[no-untyped-def]
    """q [n, H, D] at positions context_len.., keys/values [S, Hkv, D] for positions 0..S-1."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(n):
        pos = context_len + i
        for h in range(heads):
            visible = [j for j in range(pos + 1) if window is None or j > pos - window]
            k = keys[visible, h // group].double()
            scores = (k @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(scores, 0) @ values[visible, h // group].double()
    return out


def random_case(seed: int, heads: int, kv_heads: int, head_dim: int, block_size: int):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    batch = rng.randint(1, 5)
    seq_lens = [rng.randint(1, 3 * block_size + 3) for _ in range(batch)]
    query_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]  # decode, prefill, chunk
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
    full_k = [torch.randn(s, kv_heads, head_dim) for s in seq_lens]
    full_v = [torch.randn(s, kv_heads, head_dim) for s in seq_lens]
    return seq_lens, query_lens, tables, num_blocks, full_k, full_v


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window"),
    [(4, 4, 16, None), (8, 2, 32, None), (6, 1, 64, 5), (4, 2, 8, 1)],
)
def test_paged_attention_matches_naive(
    seed: int, heads: int, kv_heads: int, head_dim: int, window: int | None
):
    torch.manual_seed(seed)
    block_size = 4
    seq_lens, query_lens, tables, num_blocks, full_k, full_v = random_case(seed, heads, kv_heads, head_dim, 4)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = KVCacheLayer(torch.zeros(shape), torch.zeros(shape))
    slots, new_k, new_v, queries = [], [], [], []
    for table, s, n, k, v in zip(tables, seq_lens, query_lens, full_k, full_v, strict=True):
        for pos in range(s):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < s - n:  # context already cached by earlier steps
                cache.key.view(-1, kv_heads, head_dim)[slot] = k[pos]
                cache.value.view(-1, kv_heads, head_dim)[slot] = v[pos]
            else:
                slots.append(slot)
        new_k.append(k[s - n :])
        new_v.append(v[s - n :])
        queries.append(torch.randn(n, heads, head_dim))
    width = max(len(t) for t in tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
    )
    layer = AttentionLayer(0, heads, kv_heads, head_dim, head_dim**-0.5, window)
    out = TorchAttentionBackend().forward(
        layer, torch.cat(queries), torch.cat(new_k), torch.cat(new_v), metadata, cache
    )
    expected = torch.cat(
        [
            naive_attention(q, k, v, layer.scale, window, s - n)
            for q, k, v, s, n in zip(queries, full_k, full_v, seq_lens, query_lens, strict=True)
        ]
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_without_cache_each_sequence_attends_to_itself() -> None:
    torch.manual_seed(0)
    lens = [3, 1, 6]
    q, k, v = (torch.randn(sum(lens), 4, 8) for _ in range(3))
    layer = AttentionLayer(0, 4, 4, 8, 0.3, None)
    out = TorchAttentionBackend().forward(layer, q, k, v, AttentionMetadata.for_prefill(lens), None)
    expected, start = [], 0
    for n in lens:
        expected.append(
            naive_attention(q[start : start + n], k[start : start + n], v[start : start + n], 0.3, None, 0)
        )
        start += n
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_negative_slots_are_not_written() -> None:
    cache = KVCacheLayer(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([1, 1], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=1,
        slot_mapping=torch.tensor([2, -1]),
        block_tables=torch.tensor([[1], [0]], dtype=torch.int32),
    )
    kv = torch.ones(2, 1, 4)
    TorchAttentionBackend().forward(
        AttentionLayer(0, 1, 1, 4, 0.5), torch.ones(2, 1, 4), kv, kv, metadata, cache
    )
    assert cache.key.view(-1, 4)[2].eq(1).all()
    assert cache.key.view(-1, 4)[[0, 1, 3]].eq(0).all()


@pytest.mark.parametrize("skip_some", [False, True])
def test_kv_write_matches_a_row_by_row_store(skip_some: bool) -> None:
    """Strided K/V rows (views into a fused projection, as models pass them) land in their flat slots."""
    generator = torch.Generator().manual_seed(1)
    fused = torch.randn(6, 3 * 8, generator=generator)
    key, value = fused[:, 8:16].view(6, 2, 4), fused[:, 16:].view(6, 2, 4)
    slots = torch.randperm(12, generator=generator)[:6].to(torch.int32)
    if skip_some:
        slots[[1, 4]] = -1
    cache = KVCacheLayer(torch.zeros(3, 4, 2, 4), torch.zeros(3, 4, 2, 4))
    expected = KVCacheLayer(torch.zeros(3, 4, 2, 4), torch.zeros(3, 4, 2, 4))
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected.key.view(-1, 2, 4)[slot] = key[row]
            expected.value.view(-1, 2, 4)[slot] = value[row]
    write_kv_cache(cache, key, value, slots)
    assert torch.equal(cache.key, expected.key) and torch.equal(cache.value, expected.value)
