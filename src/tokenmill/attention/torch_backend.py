"""Reference attention in plain PyTorch: runs anywhere, and is what faster backends are tested against.

Packed sequences are padded into a ``[B, max_len]`` batch, the cached context is gathered through the
block tables, and one masked ``scaled_dot_product_attention`` call covers prefill, chunked prefill,
decode and any mix of them.
"""

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionLayer
from tokenmill.attention.context import AttentionMetadata, KVCacheLayer


class TorchAttentionBackend(AttentionBackend):
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCacheLayer | None,
    ) -> torch.Tensor:
        layout = _layout(metadata, query.shape[0])
        if kv_cache is not None:
            write_kv_cache(kv_cache, key, value, _require(metadata.slot_mapping, "slot_mapping"))
            block_tables = _require(metadata.block_tables, "block_tables")
            keys = gather_kv_cache(kv_cache.key, block_tables, metadata.max_seq_len)
            values = gather_kv_cache(kv_cache.value, block_tables, metadata.max_seq_len)
        else:
            keys, values = key[layout.padded_index], value[layout.padded_index]
        mask = layout.mask(metadata, keys.shape[1], layer.sliding_window)
        out = F.scaled_dot_product_attention(
            query[layout.padded_index].transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask.unsqueeze(1),
            scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return out.transpose(1, 2)[layout.seq_of_token, layout.offset_in_seq]


class _PaddedLayout:
    """Index maps between the packed ``[T]`` rows and the padded ``[B, max_query_len]`` batch, and the
    attention masks, computed once per forward pass and shared by every layer."""

    def __init__(self, metadata: AttentionMetadata, num_tokens: int) -> None:
        self.padded_index = padded_token_index(metadata, num_tokens)
        starts = metadata.query_start_loc.long()
        query_lens = starts[1:] - starts[:-1]
        device = starts.device
        self.seq_of_token = torch.repeat_interleave(
            torch.arange(metadata.num_seqs, device=device), query_lens, output_size=num_tokens
        )
        self.offset_in_seq = torch.arange(num_tokens, device=device) - starts[self.seq_of_token]
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}

    def mask(self, metadata: AttentionMetadata, num_keys: int, window: int | None) -> torch.Tensor:
        if (num_keys, window) not in self._masks:
            self._masks[num_keys, window] = causal_mask(metadata, num_keys, window)
        return self._masks[num_keys, window]


def _layout(metadata: AttentionMetadata, num_tokens: int) -> _PaddedLayout:
    layout = metadata.derived.get(_PaddedLayout)
    if layout is None:
        layout = metadata.derived[_PaddedLayout] = _PaddedLayout(metadata, num_tokens)
    return layout


def _require(tensor: torch.Tensor | None, name: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"attention with a KV cache needs metadata.{name}")
    return tensor


def write_kv_cache(cache: KVCacheLayer, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store each new token's K/V at its flat slot (block * block_size + offset); slot -1 is skipped."""
    keep = slots >= 0
    slots = slots[keep]
    cache.key.view(-1, *cache.key.shape[2:])[slots] = key[keep].to(cache.key.dtype)
    cache.value.view(-1, *cache.value.shape[2:])[slots] = value[keep].to(cache.value.dtype)


def gather_kv_cache(pool: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """``[num_blocks, block_size, H, D]`` pool → ``[B, max_seq_len, H, D]`` per-sequence context."""
    block_size = pool.shape[1]
    blocks_needed = -(-max_seq_len // block_size)
    gathered = pool[block_tables[:, :blocks_needed].long()]  # [B, blocks, block_size, H, D]
    return gathered.flatten(1, 2)[:, :max_seq_len]


def padded_token_index(metadata: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """``[B, max_query_len]`` packed row of each padded position; padding repeats the sequence's first row."""
    starts = metadata.query_start_loc[:-1].long()
    query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
    offsets = torch.arange(metadata.max_query_len, device=starts.device)
    index = starts[:, None] + offsets[None, :]
    index = torch.where(offsets[None, :] < query_lens[:, None], index, starts[:, None])
    return index.clamp(max=num_tokens - 1)


def causal_mask(metadata: AttentionMetadata, num_keys: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean ``[B, max_query_len, num_keys]``: may query ``i`` of sequence ``b`` see key position ``j``."""
    seq_lens = metadata.seq_lens.long()
    query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
    offsets = torch.arange(metadata.max_query_len, device=seq_lens.device)
    # Absolute position of each query; padding rows copy the last real query so no row is fully masked.
    query_pos = torch.minimum((seq_lens - query_lens)[:, None] + offsets[None, :], (seq_lens - 1)[:, None])
    key_pos = torch.arange(num_keys, device=seq_lens.device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    return mask
