"""The KV cache as the scheduler sees it: a handful of calls, one implementation per ``kv_cache`` mode.

The scheduler asks :meth:`~KVCacheManager.match` how much of a sequence's prefix is cached,
:meth:`~KVCacheManager.allocate` for slots (keeping some blocks free for admission rules),
:meth:`~KVCacheManager.cache_full_blocks` once a step has computed tokens, :meth:`~KVCacheManager.free`
when a sequence ends or is preempted, and :meth:`~KVCacheManager.rollback` to give back slots of tokens
that turned out not to be needed (rejected speculative tokens). The runner reads the block tables of the
sequences it runs (:meth:`~KVCacheManager.paging_arrays`).

* :class:`PagedKVCacheManager`: blocks of ``block_size`` tokens from a shared pool (``paged``), or one
  block of ``max_model_len`` slots per sequence (``contiguous``);
* :class:`PrefixCachingKVCacheManager`: paged, plus a radix tree of full blocks that later sequences with
  the same prefix share instead of recomputing;
* :class:`RecomputeKVCacheManager` (``none``): keeps nothing, so every step recomputes each sequence from
  its first token.
"""

import sys
from abc import ABC, abstractmethod
from collections import abc
from dataclasses import dataclass

import numpy as np

from tokenmill.cache.block_manager import BlockManager
from tokenmill.cache.radix_cache import PrefixMatch, RadixCache, RadixNode
from tokenmill.sequence import Sequence


@dataclass(frozen=True)
class PrefixHit:
    """The cached prefix :meth:`KVCacheManager.match` found: ``num_tokens`` of a ``num_query_tokens``-token
    lookup (0 and 0 where nothing is looked up). Hand it to ``allocate`` to share those blocks."""

    num_tokens: int = 0
    num_query_tokens: int = 0
    match: PrefixMatch | None = None


NO_HIT = PrefixHit()


class KVCacheManager(ABC):
    """Block bookkeeping for the sequences in flight, keyed by the :class:`Sequence` objects themselves: ids
    need not be unique (request ``"x[0]"`` and sequence 0 of a request ``"x"`` with ``n=2`` share one)."""

    block_size: int

    @abstractmethod
    def match(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of ``seq``'s tokens (nothing is pinned until ``allocate``)."""

    @abstractmethod
    def allocate(
        self, seq: Sequence, num_tokens: int, keep_free: int = 0, prefix: PrefixHit = NO_HIT
    ) -> bool:
        """Give ``seq`` slots for its first ``num_tokens`` tokens, starting its table with ``prefix``'s
        blocks, if that leaves at least ``keep_free`` blocks free; False (taking nothing) otherwise."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release everything ``seq`` holds (a no-op for a sequence that holds nothing)."""

    @abstractmethod
    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the slots of ``seq``'s last ``num_tokens`` allocated tokens."""

    @abstractmethod
    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s computed full blocks for reuse by later sequences (where prefixes are cached)."""

    @abstractmethod
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``allocate(seq, num_tokens)`` would take."""

    @abstractmethod
    def blocks_for_tokens(self, num_tokens: int) -> int: ...

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @property
    @abstractmethod
    def capacity_tokens(self) -> int:
        """The most tokens the whole cache holds for one sequence."""

    @abstractmethod
    def tokens_kept(self, num_computed: int) -> int:
        """How many of a sequence's ``num_computed`` tokens stay computed after its step (its KV kept)."""

    @abstractmethod
    def usage(self) -> float:
        """The share of the pool held by sequences."""

    @property
    @abstractmethod
    def num_used_blocks(self) -> int: ...

    @abstractmethod
    def paging_arrays(
        self, seqs: abc.Sequence[Sequence], starts: np.ndarray, ends: np.ndarray, width: int | None = None
    ) -> dict[str, np.ndarray]:
        """The step's ``slot_mapping`` (int64, one slot per token ``starts[i]:ends[i]`` of each sequence,
        packed) and ``block_tables`` (int32 ``[len(seqs), width]``); none without a pool."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise if the bookkeeping disagrees with itself (``debug_checks``)."""

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix no sequence holds (where prefixes are cached)."""


class RecomputeKVCacheManager(KVCacheManager):
    """``kv_cache="none"``: no pool, so nothing to allocate and every token is recomputed each step."""

    block_size = 1

    def match(self, seq: Sequence) -> PrefixHit:
        return NO_HIT

    def allocate(
        self, seq: Sequence, num_tokens: int, keep_free: int = 0, prefix: PrefixHit = NO_HIT
    ) -> bool:
        return True

    def free(self, seq: Sequence) -> None:
        pass

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def cache_full_blocks(self, seq: Sequence) -> None:
        pass

    def check_integrity(self) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return 0

    @property
    def num_free_blocks(self) -> int:
        return 0

    @property
    def capacity_tokens(self) -> int:
        return sys.maxsize

    def tokens_kept(self, num_computed: int) -> int:
        return 0

    def usage(self) -> float:
        return 0.0

    @property
    def num_used_blocks(self) -> int:
        return 0

    def paging_arrays(
        self, seqs: abc.Sequence[Sequence], starts: np.ndarray, ends: np.ndarray, width: int | None = None
    ) -> dict[str, np.ndarray]:
        return {}


class PagedKVCacheManager(KVCacheManager):
    """Block tables over a pool of ``num_blocks`` blocks of ``block_size`` slots."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.blocks = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self._num_tokens: dict[Sequence, int] = {}  # slots allocated per sequence (for rollback)

    def match(self, seq: Sequence) -> PrefixHit:
        return NO_HIT

    def allocate(
        self, seq: Sequence, num_tokens: int, keep_free: int = 0, prefix: PrefixHit = NO_HIT
    ) -> bool:
        held = self._num_tokens.get(seq)
        if held is not None and not keep_free and num_tokens <= self.blocks.num_slots(seq):
            # Within the blocks it holds (most decode steps): nothing to take.
            self._num_tokens[seq] = max(num_tokens, held)
            return True
        if self.blocks_needed(seq, num_tokens) + keep_free > self.num_free_blocks:
            return False
        self._grow(seq, num_tokens)
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        self.blocks.allocate(seq, num_tokens)
        self._num_tokens[seq] = max(num_tokens, self._num_tokens.get(seq, 0))

    def free(self, seq: Sequence) -> None:
        if seq in self.blocks:
            self.blocks.free(seq)
        self._num_tokens.pop(seq, None)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        held = self._num_tokens.get(seq, 0)
        if not 0 <= num_tokens <= held:
            raise ValueError(
                f"cannot roll back {num_tokens} of the {held} slots sequence {seq.seq_id!r} holds"
            )
        if num_tokens == 0:
            return
        self._num_tokens[seq] = held - num_tokens
        self.blocks.truncate(seq, self.blocks_for_tokens(held - num_tokens))

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return self.blocks.blocks_needed(seq, num_tokens)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return self.blocks.blocks_for_tokens(num_tokens)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.block_size

    def tokens_kept(self, num_computed: int) -> int:
        return num_computed

    def cache_full_blocks(self, seq: Sequence) -> None:
        pass  # nothing is shared without a prefix cache

    def usage(self) -> float:
        return self.blocks.usage()

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.allocator.num_used

    def block_table(self, seq: Sequence) -> list[int]:
        return self.blocks.block_table(seq)

    def paging_arrays(
        self, seqs: abc.Sequence[Sequence], starts: np.ndarray, ends: np.ndarray, width: int | None = None
    ) -> dict[str, np.ndarray]:
        tables = [self.blocks.table_view(seq) for seq in seqs]
        padded = self.blocks.padded_tables(tables, np.int32, width)
        return {"slot_mapping": self.blocks.slots(tables, starts, ends, padded), "block_tables": padded}

    def check_integrity(self) -> None:
        self.blocks.check_integrity()

    def reset_prefix_cache(self) -> None:
        pass  # no prefixes cached


class PrefixCachingKVCacheManager(PagedKVCacheManager):
    """Paged blocks plus a radix tree of full blocks: a sequence whose prompt starts like an earlier one
    (with the same ``cache_salt``) shares that prefix's blocks (pinned by a lock on its tree path while the
    sequence holds them)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.tree = RadixCache(self.blocks.allocator, block_size)
        self._locked: dict[Sequence, RadixNode] = {}  # the cached prefix each sequence pins
        self._num_cached_blocks: dict[Sequence, int] = {}  # how many of its full blocks were inserted

    def match(self, seq: Sequence) -> PrefixHit:
        match = self.tree.match_prefix(seq.token_ids, seq.cache_salt)
        if not match.blocks:
            return PrefixHit(0, match.num_query_tokens)
        return PrefixHit(match.num_tokens, match.num_query_tokens, match)

    def allocate(
        self, seq: Sequence, num_tokens: int, keep_free: int = 0, prefix: PrefixHit = NO_HIT
    ) -> bool:
        match = prefix.match
        if match is None:
            return super().allocate(seq, num_tokens, keep_free)
        new_blocks = self.blocks_for_tokens(num_tokens) - len(match.blocks)
        if new_blocks + keep_free > self.tree.num_free_after_lock(match):
            return False
        self.tree.lock(match)
        self._locked[seq] = match.node
        self._num_cached_blocks[seq] = len(match.blocks)  # in the tree already: never rolled back
        self.blocks.share_prefix(seq, match.blocks)
        self._grow(seq, num_tokens)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        full_blocks = seq.num_computed_tokens // self.block_size
        if full_blocks > self._num_cached_blocks.get(seq, 0):
            tokens = seq.token_ids[: full_blocks * self.block_size]
            self.tree.insert(tokens, self.blocks.table_view(seq), seq.cache_salt)
            self._num_cached_blocks[seq] = full_blocks

    def free(self, seq: Sequence) -> None:
        """Unpin the cached prefix, then drop the table: blocks the tree holds stay cached (evicted LRU
        when the pool runs dry), the rest are free at once."""
        node = self._locked.pop(seq, None)
        self._num_cached_blocks.pop(seq, None)
        if node is not None:
            self.tree.unlock(node)
        super().free(seq)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        cached_tokens = self._num_cached_blocks.get(seq, 0) * self.block_size
        if self._num_tokens.get(seq, 0) - num_tokens < cached_tokens:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens of {seq.seq_id!r}: they are in the prefix cache"
            )
        super().rollback(seq, num_tokens)

    def check_integrity(self) -> None:
        self.tree.check_integrity(self.blocks)

    def reset_prefix_cache(self) -> None:
        self.tree.evict(self.blocks.num_blocks)


def create_kv_cache_manager(
    mode: str, num_blocks: int, block_size: int, prefix_caching: bool
) -> KVCacheManager:
    """The manager for ``kv_cache`` mode ``mode`` (``block_size``: ``max_model_len`` for contiguous)."""
    if mode == "none":
        return RecomputeKVCacheManager()
    if prefix_caching:
        return PrefixCachingKVCacheManager(num_blocks, block_size)
    return PagedKVCacheManager(num_blocks, block_size)
