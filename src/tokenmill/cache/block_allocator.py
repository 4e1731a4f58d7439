"""Reference-counted allocation of the fixed-size KV blocks that make up the paged cache.

A block is in exactly one of three states:

* **free**: refcount 0, on the free list, its contents meaningless;
* **used**: refcount > 0, held by one or more owners (sequence block tables, a prefix cache);
* **cached**: refcount 0 but kept aside with its contents intact, because an attached
  :class:`BlockCacheHook` (a prefix cache) asked to retain it. A cached block can be revived by
  :meth:`BlockAllocator.incref`, and is evicted (least recently released first) when the free list runs
  dry, so it always counts as free for scheduling.
"""

from collections import OrderedDict, deque
from typing import Protocol

from tokenmill.errors import TokenmillError


class NoFreeBlocksError(TokenmillError):
    """More KV blocks were asked for than are free; nothing was allocated."""

    def __init__(self, requested: int, available: int, total: int) -> None:
        super().__init__(
            f"cannot allocate {requested} KV block(s): only {available} of {total} are free "
            "(preempt or finish sequences, or give the cache more memory)"
        )
        self.requested = requested
        self.available = available
        self.total = total


class CacheIntegrityError(TokenmillError):
    """The cache's bookkeeping contradicts itself: a bug, never a user error."""


class BlockCacheHook(Protocol):
    """What a prefix cache implements to keep released blocks' contents for later reuse.

    The prefix cache holds its own references with :meth:`BlockAllocator.incref` / ``decref`` like any
    other owner; this hook only covers the moment a block's last reference goes away.
    """

    def should_retain(self, block_id: int) -> bool:
        """The block's refcount just reached zero: True keeps it cached instead of freeing it."""
        ...

    def on_evict(self, block_id: int) -> None:
        """A cached block is being reused for something else: forget what it held."""
        ...


class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks-1`` with O(1) allocate, incref and decref."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block allocator needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Insertion order is release order, so popping from the front evicts the least recently released.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._num_used = 0
        self._hook: BlockCacheHook | None = None

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out now, cached ones included."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks whose contents a prefix cache keeps until they are evicted."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self._num_used

    def refcount(self, block_id: int) -> int:
        self._check_block_id(block_id)
        return self._refcounts[block_id]

    def is_cached(self, block_id: int) -> bool:
        self._check_block_id(block_id)
        return block_id in self._cached

    def allocate(self) -> int:
        """A block with refcount 1; a free one if any, else the least recently released cached one."""
        if self._free:
            block_id = self._free.popleft()
        elif self._cached:
            block_id = self._evict_oldest_cached()
        else:
            raise NoFreeBlocksError(1, 0, self.num_blocks)
        self._refcounts[block_id] = 1
        self._num_used += 1
        return block_id

    def allocate_many(self, count: int) -> list[int]:
        """``count`` blocks, or :class:`NoFreeBlocksError` with nothing allocated."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({count})")
        if count > self.num_free:
            raise NoFreeBlocksError(count, self.num_free, self.num_blocks)
        return [self.allocate() for _ in range(count)]

    def incref(self, block_id: int) -> int:
        """Add an owner to a used block, or revive a cached one; returns the new refcount."""
        self._check_block_id(block_id)
        if self._refcounts[block_id] == 0:
            if block_id not in self._cached:
                raise ValueError(f"incref of free block {block_id}: allocate it before sharing it")
            del self._cached[block_id]
            self._num_used += 1
        self._refcounts[block_id] += 1
        return self._refcounts[block_id]

    def decref(self, block_id: int) -> int:
        """Drop one owner; at zero the block is freed (or cached, if the hook retains it)."""
        self._check_block_id(block_id)
        if self._refcounts[block_id] == 0:
            raise ValueError(f"decref of block {block_id}, which has no references (double free?)")
        self._refcounts[block_id] -= 1
        if self._refcounts[block_id] == 0:
            self._num_used -= 1
            self._release(block_id)
        return self._refcounts[block_id]

    def attach_cache_hook(self, hook: BlockCacheHook | None) -> None:
        """Install (or, with None, remove) the prefix cache; removing it evicts every cached block."""
        if hook is None:
            self.evict_all_cached()
        self._hook = hook

    def drop_cached(self, block_id: int) -> None:
        """Move a cached block to the free list without calling ``on_evict`` (its owner asked for this)."""
        self._check_block_id(block_id)
        if block_id not in self._cached:
            raise ValueError(f"block {block_id} is not cached")
        del self._cached[block_id]
        self._free.append(block_id)

    def cached_blocks(self) -> list[int]:
        """The cached block ids in eviction order: least recently released first."""
        return list(self._cached)

    def evict_cached(self, count: int) -> int:
        """Free up to ``count`` cached blocks, least recently released first; returns how many it evicted.

        The hook may drop further cached blocks itself (with :meth:`drop_cached`) while it forgets one.
        """
        if count < 0:
            raise ValueError(f"cannot evict a negative number of blocks ({count})")
        evicted = 0
        while self._cached and evicted < count:
            self._free.append(self._evict_oldest_cached())
            evicted += 1
        return evicted

    def evict_all_cached(self) -> None:
        self.evict_cached(self.num_cached)

    def check_integrity(self) -> None:
        """Raise :class:`CacheIntegrityError` if free list, cache and refcounts disagree. O(num_blocks)."""
        free = set(self._free)
        _expect(len(free) == len(self._free), "the free list holds a block twice")
        _expect(not free & self._cached.keys(), "a block is both on the free list and cached")
        for block_id in free | self._cached.keys():
            _expect(self._refcounts[block_id] == 0, f"free block {block_id} has a nonzero refcount")
        used = [b for b, count in enumerate(self._refcounts) if count > 0]
        _expect(all(count >= 0 for count in self._refcounts), "a refcount is negative")
        _expect(len(used) == self._num_used, f"num_used is {self._num_used} but {len(used)} blocks are used")
        accounted = len(free) + len(self._cached) + len(used)
        _expect(accounted == self.num_blocks, f"{accounted} blocks accounted for, of {self.num_blocks}")

    def _evict_oldest_cached(self) -> int:
        block_id, _ = self._cached.popitem(last=False)
        if self._hook is not None:
            self._hook.on_evict(block_id)
        return block_id

    def _release(self, block_id: int) -> None:
        if self._hook is not None and self._hook.should_retain(block_id):
            self._cached[block_id] = None
        else:
            self._free.append(block_id)

    def _check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is out of range [0, {self.num_blocks})")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CacheIntegrityError(message)
