"""Reference attention in plain PyTorch: runs anywhere, and is what faster backends are tested against.

A step's sequences split into two groups, planned once per forward pass and shared by every layer:

- decodes (one new token each) run as one batched ``scaled_dot_product_attention`` call over their
  contexts, gathered through the block tables into ``[B, longest context]`` and masked by length;
- prefill chunks (several new tokens) run one call per sequence with exactly their own context, causal,
  so a long prompt never pads the decodes beside it (nor they it).

Without a KV cache every sequence's context is its own new tokens.
"""

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionLayer, PendingRotary
from tokenmill.attention.metadata import AttentionMetadata, KVCacheLayer


class TorchAttentionBackend(AttentionBackend):
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCacheLayer | None,
        rotary: PendingRotary | None = None,
    ) -> torch.Tensor:
        if rotary is not None:
            query, key = rotary.apply(query, key)
        plan = _plan(metadata, kv_cache)
        if kv_cache is not None:
            assert plan.write is not None
            plan.write.store(kv_cache, key, value)
            keys = kv_cache.key.flatten(0, 1)  # [slots, H_kv, D]: contexts are read by flat slot
            values = kv_cache.value.flatten(0, 1)
        else:
            keys, values = key, value  # contexts are the packed rows themselves
        out = torch.empty_like(query)
        if plan.decode is not None:
            out.index_copy_(0, plan.decode.rows, _decode_attention(layer, query, keys, values, plan.decode))
        for chunk in plan.prefills:
            out[chunk.rows] = _prefill_attention(layer, query, keys, values, chunk)
        return out


@dataclass
class _DecodeGroup:
    """Every one-token query of the step, attending over its context padded to the longest one."""

    rows: torch.Tensor  # [B] packed query rows
    context: torch.Tensor  # [B, L] where each context token's K/V lives (a slot, or a packed row)
    seq_lens: torch.Tensor  # [B]
    _masks: dict[int | None, torch.Tensor]

    def mask(self, window: int | None) -> torch.Tensor:
        """``[B, 1, 1, L]``: keys inside the sequence (and inside the window) of the last position."""
        if window not in self._masks:
            key_pos = torch.arange(self.context.shape[1], device=self.context.device)
            lens = self.seq_lens[:, None]
            visible = key_pos[None, :] < lens
            if window is not None:
                visible &= key_pos[None, :] >= lens - window
            self._masks[window] = visible[:, None, None, :]
        return self._masks[window]


@dataclass
class _PrefillChunk:
    """One sequence's several new tokens, the last ``len(rows)`` of its ``len(context)`` positions."""

    rows: slice
    context: torch.Tensor  # [L]
    _masks: dict[int | None, torch.Tensor | None]

    def mask(self, window: int | None) -> torch.Tensor | None:
        """``[Q, L]`` causal (and windowed) mask; None when plain ``is_causal`` says the same."""
        num_queries, num_keys = self.rows.stop - self.rows.start, self.context.shape[0]
        if window is not None and window >= num_keys:
            window = None
        if window is None and num_queries == num_keys:
            return None
        if window not in self._masks:
            query_pos = torch.arange(num_keys - num_queries, num_keys, device=self.context.device)
            key_pos = torch.arange(num_keys, device=self.context.device)
            visible = key_pos[None, :] <= query_pos[:, None]
            if window is not None:
                visible &= key_pos[None, :] > query_pos[:, None] - window
            self._masks[window] = visible
        return self._masks[window]


@dataclass
class _KVWrite:
    """Where the step's new K/V go: row ``rows[i]`` (every row when None) to flat slot ``slots[i]``."""

    slots: torch.Tensor
    rows: torch.Tensor | None

    @classmethod
    def from_slot_mapping(cls, slot_mapping: torch.Tensor) -> "_KVWrite":
        """Rows with slot -1 are skipped; checked once here, so each layer writes with one ``index_copy_``."""
        keep = slot_mapping >= 0
        if bool(keep.all()):
            return cls(slot_mapping, None)
        rows = keep.nonzero().flatten()
        return cls(slot_mapping[rows], rows)

    def store(self, cache: KVCacheLayer, key: torch.Tensor, value: torch.Tensor) -> None:
        for pool, new in ((cache.key, key), (cache.value, value)):
            if self.rows is not None:
                new = new.index_select(0, self.rows)
            flat, new = pool.view(-1, *pool.shape[2:]), new.to(pool.dtype)
            if pool.dtype.itemsize == 1:  # float8 (kv_cache_dtype fp8): index_copy_ takes its bytes
                flat, new = flat.view(torch.uint8), new.view(torch.uint8)
            flat.index_copy_(0, self.slots, new)


@dataclass
class _StepPlan:
    decode: _DecodeGroup | None
    prefills: list[_PrefillChunk]
    write: _KVWrite | None  # None without a KV cache


def _plan(metadata: AttentionMetadata, kv_cache: KVCacheLayer | None) -> _StepPlan:
    plan = metadata.derived.get(_StepPlan)
    if plan is None:
        plan = metadata.derived[_StepPlan] = _build_plan(metadata, kv_cache)
    return plan


def _build_plan(metadata: AttentionMetadata, kv_cache: KVCacheLayer | None) -> _StepPlan:
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    device = metadata.seq_lens.device
    locate, write = None, None
    if kv_cache is not None:
        locate = _SlotLocator(_require(metadata.block_tables, "block_tables").long(), kv_cache.block_size)
        write = _KVWrite.from_slot_mapping(_require(metadata.slot_mapping, "slot_mapping").long())
    query_lens = [end - start for start, end in pairwise(starts)]
    decode_seqs = [b for b, query_len in enumerate(query_lens) if query_len == 1]
    prefills = []
    for b in (b for b, query_len in enumerate(query_lens) if query_len > 1):
        positions = torch.arange(seq_lens[b], device=device)
        context = (
            locate(torch.tensor([b], device=device), positions[None, :])[0]
            if locate is not None
            else positions + starts[b]
        )
        prefills.append(_PrefillChunk(slice(starts[b], starts[b + 1]), context, {}))
    decode = None
    if decode_seqs:
        seqs = torch.tensor(decode_seqs, device=device)
        longest = max(seq_lens[b] for b in decode_seqs)
        positions = torch.arange(longest, device=device)[None, :].expand(len(decode_seqs), -1)
        rows = metadata.query_start_loc[seqs].long()
        # Without a cache a decode query is a whole one-token sequence: its only key is itself.
        context = locate(seqs, positions) if locate is not None else rows[:, None]
        decode = _DecodeGroup(rows, context, metadata.seq_lens[seqs].long(), {})
    return _StepPlan(decode, prefills, write)


class _SlotLocator:
    """Flat KV slot of position ``p`` of sequence ``b``: ``table[b][p // bs] * bs + p % bs``, ``bs`` the
    block size. Positions past a sequence's end land in padding blocks (block 0), which the masks hide."""

    def __init__(self, block_tables: torch.Tensor, block_size: int) -> None:
        self.block_tables = block_tables
        self.block_size = block_size

    def __call__(self, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        table_cols = (positions // self.block_size).clamp(max=self.block_tables.shape[1] - 1)
        blocks = self.block_tables[seqs[:, None], table_cols]
        return blocks * self.block_size + positions % self.block_size


def _decode_attention(
    layer: AttentionLayer,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: _DecodeGroup,
) -> torch.Tensor:
    # Query heads sharing a KV head become that head's several queries: GQA without repeating K/V.
    batch, group_size = group.rows.shape[0], layer.num_heads // layer.num_kv_heads
    q = query.index_select(0, group.rows).view(batch, layer.num_kv_heads, group_size, layer.head_dim)
    k = _gather(keys, group.context).transpose(1, 2)  # [B, H_kv, L, D]
    v = _gather(values, group.context).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=group.mask(layer.sliding_window), scale=layer.scale
    )
    return out.reshape(batch, layer.num_heads, layer.head_dim)


def _prefill_attention(
    layer: AttentionLayer,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk: _PrefillChunk,
) -> torch.Tensor:
    q = query[chunk.rows].transpose(0, 1)  # [H, Q, D]
    k = _gather(keys, chunk.context).transpose(0, 1).to(q.dtype)  # [H_kv, L, D]
    v = _gather(values, chunk.context).transpose(0, 1).to(q.dtype)
    mask = chunk.mask(layer.sliding_window)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=layer.scale,
        enable_gqa=layer.num_heads != layer.num_kv_heads,
    )
    return out.transpose(0, 1)


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` for any index shape; ``index_select`` on the flat index is several times faster
    than advanced indexing on CPU."""
    return rows.index_select(0, index.flatten()).view(*index.shape, *rows.shape[1:])


def _require(tensor: torch.Tensor | None, name: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"attention with a KV cache needs metadata.{name}")
    return tensor


def write_kv_cache(cache: KVCacheLayer, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store each new token's K/V at its flat slot (block * block_size + offset); slot -1 is skipped."""
    _KVWrite.from_slot_mapping(slots.long()).store(cache, key, value)
