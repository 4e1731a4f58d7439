"""Per-sequence block tables over a :class:`BlockAllocator`, and the step arrays built from them.

Token ``p`` of a sequence lives in KV slot ``table[p // block_size] * block_size + p % block_size`` of
the flat ``[num_blocks * block_size]`` pool that the attention backends index (:meth:`BlockManager.slots`).
"""

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeAlias

import numpy as np

from tokenmill.cache.block_allocator import BlockAllocator, CacheIntegrityError
from tokenmill.errors import TokenmillError

SeqId: TypeAlias = Hashable


class UnknownSequenceError(TokenmillError, LookupError):
    """The sequence id has no block table: never allocated, or already freed."""


class BlockManager:
    """Owns the block table of every live sequence; each table holds one reference to each of its blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._tables: dict[SeqId, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def usage(self) -> float:
        """Fraction of blocks referenced by someone (cached-but-unreferenced blocks count as free)."""
        return self.allocator.num_used / self.num_blocks

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def blocks_for_tokens(self, num_tokens: int) -> int:
        _check_non_negative("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)

    def num_slots(self, seq_id: SeqId) -> int:
        """Token slots ``seq_id``'s blocks hold (0 for an unknown id)."""
        return len(self._tables.get(seq_id, ())) * self.block_size

    def blocks_needed(self, seq_id: SeqId, total_tokens: int) -> int:
        """New blocks ``allocate(seq_id, total_tokens)`` would take; an unknown id counts as empty."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.blocks_for_tokens(total_tokens) - have)

    def allocate(self, seq_id: SeqId, total_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table (creating it if new) to cover ``total_tokens``; returns the added blocks.

        All or nothing: on :class:`NoFreeBlocksError` no block is taken and no table is created.
        """
        new_blocks = self.allocator.allocate_many(self.blocks_needed(seq_id, total_tokens))
        self._tables.setdefault(seq_id, []).extend(new_blocks)
        return new_blocks

    def share_prefix(self, seq_id: SeqId, blocks: Sequence[int]) -> None:
        """Start ``seq_id``'s (absent or empty) table with existing used or cached ``blocks``, taking a
        reference to each: the entry point for prefix caching. The blocks must be full, since the shared
        tokens are never rewritten."""
        if self._tables.get(seq_id):
            raise ValueError(f"sequence {seq_id!r} already has blocks; a shared prefix must come first")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"shared prefix {list(blocks)} names a block twice")
        for block_id in blocks:
            if self.allocator.refcount(block_id) == 0 and not self.allocator.is_cached(block_id):
                raise ValueError(f"block {block_id} is free; only used or cached blocks can be shared")
        for block_id in blocks:
            self.allocator.incref(block_id)
        self._tables[seq_id] = list(blocks)

    def free(self, seq_id: SeqId) -> None:
        """Drop ``seq_id``'s table and its references. An unknown id raises and changes nothing."""
        table = self._table(seq_id)
        del self._tables[seq_id]
        # Last block first: a prefix cache then evicts a sequence's tail before the prefix it hangs from.
        for block_id in reversed(table):
            self.allocator.decref(block_id)

    def truncate(self, seq_id: SeqId, num_blocks: int) -> None:
        """Keep ``seq_id``'s first ``num_blocks`` blocks, releasing the rest, last first."""
        table = self._table(seq_id)
        _check_non_negative("num_blocks", num_blocks)
        while len(table) > num_blocks:
            self.allocator.decref(table.pop())

    def block_table(self, seq_id: SeqId) -> list[int]:
        return list(self._table(seq_id))

    def table_view(self, seq_id: SeqId) -> list[int]:
        """``seq_id``'s block table itself, not a copy: read it, never change it."""
        return self._table(seq_id)

    def slots(
        self,
        tables: Sequence[list[int]],
        starts: np.ndarray,
        ends: np.ndarray,
        padded: np.ndarray | None = None,
    ) -> np.ndarray:
        """int64 KV slots of tokens ``starts[i]:ends[i]`` of the sequences with block ``tables``, packed in
        order: the one place the slot formula is written. ``padded``: the tables already padded (by
        :meth:`padded_tables`), to pad them once per step."""
        capacities = np.fromiter((len(table) for table in tables), np.int64, len(tables)) * self.block_size
        _check_ranges(starts, ends, capacities)
        row: np.ndarray | int = 0
        if len(tables) == 1:  # one sequence (a prefill graph's step): a third of the numpy calls
            positions = np.arange(starts[0], ends[0], dtype=np.int64)
        else:
            lengths = ends - starts
            row = np.repeat(np.arange(len(tables)), lengths)
            first_token = np.cumsum(lengths) - lengths
            positions = np.arange(int(lengths.sum()), dtype=np.int64) - first_token[row] + starts[row]
        if padded is None:
            padded = self.padded_tables(tables, np.int64)
        blocks = padded[row, positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size

    def padded_tables(self, tables: Sequence[list[int]], dtype: type, width: int | None = None) -> np.ndarray:
        """``[len(tables), width]`` block tables padded with block 0 (a valid id attention masks out);
        ``width`` defaults to the longest table: pass a fixed one for shapes that must not change."""
        longest = max((len(table) for table in tables), default=0)
        if width is None:
            width = longest
        elif width < longest:
            raise ValueError(f"width {width} is narrower than the longest block table ({longest} blocks)")
        padded: np.ndarray = np.zeros((len(tables), width), dtype=dtype)
        for index, table in enumerate(tables):
            padded[index, : len(table)] = table
        return padded

    def check_integrity(self, extra_refs: Mapping[int, int] | None = None) -> None:
        """Check that every block's refcount equals its holders: the tables that list it plus
        ``extra_refs`` (references held outside the tables, such as a prefix cache's). O(num_blocks)."""
        self.allocator.check_integrity()
        holders: Counter[int] = Counter()
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise CacheIntegrityError(f"sequence {seq_id!r} lists a block twice: {table}")
            holders.update(table)
        extra = extra_refs or {}
        for block_id in range(self.num_blocks):
            expected = holders[block_id] + extra.get(block_id, 0)
            actual = self.allocator.refcount(block_id)
            if actual != expected:
                raise CacheIntegrityError(f"block {block_id} has refcount {actual} but {expected} holder(s)")

    def _table(self, seq_id: SeqId) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            message = f"sequence {seq_id!r} has no block table (never allocated, or already freed)"
            raise UnknownSequenceError(message) from None


def _check_ranges(starts: np.ndarray, ends: np.ndarray, capacities: np.ndarray) -> None:
    if len(starts) == 1 and 0 <= starts[0] <= ends[0] <= capacities[0]:
        return  # the one-sequence case without the array operations
    bad = np.flatnonzero((starts < 0) | (ends < starts) | (ends > capacities))
    if bad.size:
        index = int(bad[0])
        raise IndexError(
            f"token range {starts[index]}:{ends[index]} of row {index} is not within its "
            f"{int(capacities[index])} allocated slots"
        )


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
