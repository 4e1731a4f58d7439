"""Naive references for tests of the KV cache bookkeeping, written apart from the code under test.

``naive_slot`` is the slot formula spelt out for one token, so tests can check ``BlockManager.slots`` (and
everything built on it: ``paging_arrays``, ``build_step_arrays``, the decode graphs' static buffers)
against a value that does not come from it.
"""

from collections.abc import Sequence as SequenceOf

import torch

from tokenmill.cache.kv_cache_manager import PagedKVCacheManager
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def naive_slot(table: SequenceOf[int], position: int, block_size: int) -> int:
    """Token ``position``'s KV slot in the flat pool, for a sequence with block ``table``."""
    if not 0 <= position < len(table) * block_size:
        raise IndexError(f"position {position} is outside the {len(table)} block(s) of table {table}")
    return table[position // block_size] * block_size + position % block_size


def slot_of(kv: PagedKVCacheManager, seq: Sequence, position: int) -> int:
    """``naive_slot`` of ``seq``'s token ``position``, from a copy of its block table."""
    return naive_slot(kv.block_table(seq), position, kv.block_size)


def make_sequence(seq_id: str, token_ids: SequenceOf[int], max_tokens: int = 16) -> Sequence:
    """A sequence with ``token_ids`` as its prompt, as the engine would queue it (greedy sampling)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(seq_id, list(token_ids), params, max_tokens)


def gather_kv_cache(pool: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """``[num_blocks, block_size, H, D]`` pool → ``[B, max_seq_len, H, D]`` per-sequence context."""
    block_size = pool.shape[1]
    blocks_needed = -(-max_seq_len // block_size)
    gathered = pool[block_tables[:, :blocks_needed].long()]  # [B, blocks, block_size, H, D]
    return gathered.flatten(1, 2)[:, :max_seq_len]
