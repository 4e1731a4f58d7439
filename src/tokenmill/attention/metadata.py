"""What attention needs to know about a step: where each sequence's tokens are, and the KV pool."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class KVCacheLayer:
    """One layer's KV pool: ``key`` and ``value`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    A contiguous per-sequence cache is the special case of one block of ``max_model_len`` slots per sequence.
    """

    key: torch.Tensor
    value: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.key.shape[1]


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes the packed tokens of one forward pass: ``B`` sequences, ``T`` new tokens in all.

    The new tokens of sequence ``b`` are rows ``query_start_loc[b]:query_start_loc[b+1]`` of the packed
    input; they are the last ``query_len`` of its ``seq_lens[b]`` tokens, the earlier ones being context
    already in the KV cache.
    """

    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative new-token counts
    seq_lens: torch.Tensor  # int32 [B], context + new tokens
    max_query_len: int  # host-side maxima, so kernels need no device sync to size their grids
    max_seq_len: int
    slot_mapping: torch.Tensor | None = None  # int64 [T]: flat KV slot for each new token; -1 skips
    block_tables: torch.Tensor | None = None  # int32 [B, max_blocks]: KV block ids of each sequence
    # int32 [B]: the sequences longest first, the order a batch's decode programs are launched in
    seq_order: torch.Tensor | None = None
    # What a backend derives from the fields above, computed by the first layer and reused by the rest.
    derived: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def for_prefill(
        cls, query_lens: Sequence[int], device: torch.device | str = "cpu"
    ) -> "AttentionMetadata":
        """Whole sequences with no cache: each sequence's tokens attend only to themselves."""
        lens = torch.tensor(list(query_lens), dtype=torch.int32, device=device)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32, device=device)
        starts[1:] = torch.cumsum(lens, 0)
        longest = max(query_lens)
        return cls(query_start_loc=starts, seq_lens=lens, max_query_len=longest, max_seq_len=longest)
