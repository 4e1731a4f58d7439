"""Prefix caching: a radix tree over token ids whose nodes own the KV blocks that hold those tokens.

Each edge of the tree carries a run of whole blocks: ``block_size`` tokens per block id, so a path from
the root spells a block-aligned token prefix together with the blocks whose KV was computed for exactly
that prefix. Two children of a node never start with the same block of tokens; edges are split where
a lookup or an insertion diverges (or stops) inside one.

**Who holds a tree block.** The tree takes no allocator reference just for caching a block. A request
that uses a cached prefix holds its blocks twice: once in its block table (``share_prefix``) and once
through its *lock* on the path (:meth:`RadixCache.lock`), which is the tree's own reference, reported
by :meth:`RadixCache.extra_refs`. When a tree block's last reference goes, the allocator asks the tree
(its :class:`BlockCacheHook`) whether to retain it, and it becomes *cached*: free for scheduling, its
contents kept until the allocator needs the block and evicts it.

**Eviction is LRU, leaves first.** The allocator evicts cached blocks least recently released first,
and only when its free list is dry (or through :meth:`RadixCache.evict`). That order is leaf-first
because every holder of a tree block also holds the rest of its path and lets go deepest first: a
shared prefix is a matched path, a lock covers its whole path and :meth:`~RadixCache.unlock` walks up,
:meth:`~RadixCache.insert` only adopts blocks that hang below blocks the caller holds, and
``BlockManager.free`` releases a table's last block first. So a block is never released while a
descendant is in use, and by the time it is evicted its descendants have been. A block's recency is its
last release: a match that is never locked does not refresh it, and re-inserting a path the caller still
holds needs no refresh (its blocks become most recent when the caller releases them).
:meth:`~RadixCache.check_integrity` verifies all of this.

**How it is used**: :class:`~tokenmill.cache.kv_cache_manager.PrefixCachingKVCacheManager` matches a
sequence's tokens at admission, locks the match and shares its blocks, inserts the sequence's full
blocks as they are computed, and unlocks the path when the sequence is freed.

A request admitted in the same step as an identical one computes its own copy of the prompt's blocks;
:meth:`~RadixCache.insert` then keeps the tree's copy and the duplicates are freed with the table.

**Cache salts** (vLLM's ``cache_salt``): each salt has a tree of its own, under a root of its own, so
requests share blocks only with requests of the same salt (or, unsalted, with the unsalted ones). A
salted root lives while its tree holds blocks.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise

from tokenmill.cache.block_allocator import BlockAllocator, CacheIntegrityError
from tokenmill.cache.block_manager import BlockManager

Tokens = tuple[int, ...]


class RadixNode:
    """A node and the edge leading to it: ``tokens`` fill ``blocks`` exactly, ``block_size`` per block.

    ``lock_count`` is the number of locks whose path passes through the node. The root has no tokens.
    """

    __slots__ = ("attached", "blocks", "children", "lock_count", "parent", "tokens")

    def __init__(self, tokens: Tokens, blocks: list[int], parent: "RadixNode | None") -> None:
        self.tokens = tokens
        self.blocks = blocks
        self.parent = parent
        self.children: dict[Tokens, RadixNode] = {}  # keyed by the child's first block of tokens
        self.lock_count = 0
        self.attached = True  # False once eviction removed it: a stale handle

    def path(self) -> list["RadixNode"]:
        """The nodes from just below the root down to this one (none for the root)."""
        nodes: list[RadixNode] = []
        node: RadixNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def __repr__(self) -> str:
        return f"RadixNode(blocks={self.blocks}, locks={self.lock_count}, children={len(self.children)})"


@dataclass(frozen=True)
class PrefixMatch:
    """The cached blocks for the first ``num_tokens`` tokens of a ``num_query_tokens``-token query.

    ``node`` ends the matched path (the root when nothing matched); lock it before using ``blocks``.
    """

    blocks: tuple[int, ...]
    num_tokens: int
    node: RadixNode
    num_query_tokens: int


class RadixCache:
    """The prefix cache of one :class:`BlockAllocator`, attached to it as its cache hook."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.root = RadixNode((), [], None)  # of the unsalted tree
        self._salted_roots: dict[str, RadixNode] = {}
        self._salt_of_root: dict[RadixNode, str] = {}
        self._node_of_block: dict[int, RadixNode] = {}
        self.num_evicted_blocks = 0
        allocator.attach_cache_hook(self)

    # --- stats ---------------------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the tree holds, in use by requests or not."""
        return len(self._node_of_block)

    # --- lookup and pinning --------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> PrefixMatch:
        """The longest cached block-aligned prefix of ``token_ids`` (in ``salt``'s tree) that leaves at
        least the last token to compute (a forward pass needs one token to sample from). Splits an edge
        the match ends in."""
        root = self._root(salt, create=False)
        if root is None:
            return PrefixMatch((), 0, self.root, len(token_ids))
        limit = max(0, (len(token_ids) - 1) // self.block_size) * self.block_size
        node, blocks = self._descend(root, tuple(token_ids[:limit]))
        return PrefixMatch(tuple(blocks), len(blocks) * self.block_size, node, len(token_ids))

    def num_free_after_lock(self, match: PrefixMatch) -> int:
        """Blocks the allocator could still hand out once ``match`` is locked (locking revives the
        matched blocks that are cached, and cached blocks count as free until then)."""
        reviving = sum(1 for block_id in match.blocks if self.allocator.is_cached(block_id))
        return self.allocator.num_free - reviving

    def lock(self, match: PrefixMatch) -> None:
        """Pin the matched path for a request (one reference per block)."""
        if self._path_blocks(match.node) != list(match.blocks):
            raise ValueError("stale prefix match: the tree changed since match_prefix; match again")
        _root_of(match.node).lock_count += 1
        for node in match.node.path():
            node.lock_count += 1
            for block_id in node.blocks:
                self.allocator.incref(block_id)

    def unlock(self, node: RadixNode) -> None:
        """Release a lock taken on ``match.node``, deepest block first."""
        if node.lock_count < 1 or not node.attached:
            raise ValueError(f"unlock of {node!r}, which holds no lock (double unlock?)")
        for path_node in reversed(node.path()):
            path_node.lock_count -= 1
            for block_id in reversed(path_node.blocks):
                self.allocator.decref(block_id)
        _root_of(node).lock_count -= 1

    # --- insertion and eviction ----------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], salt: str | None = None) -> int:
        """Cache the full blocks of ``token_ids`` (computed tokens) in ``salt``'s tree, ``blocks`` being the
        caller's block table (a trailing partial block is ignored). Returns how many leading ``blocks``
        the tree holds.

        Where the tree already caches some of these tokens under another block id it keeps its own, and
        adopts nothing below it (the caller does not hold that path); the caller's blocks from there on
        stay its alone and are freed with its table.
        """
        num_blocks = len(token_ids) // self.block_size
        if len(blocks) < num_blocks:
            raise ValueError(f"{len(token_ids)} tokens fill {num_blocks} blocks but only {len(blocks)} given")
        tokens = tuple(token_ids[: num_blocks * self.block_size])
        root = self._root(salt, create=num_blocks > 0)
        if root is None:
            return 0
        node, cached_blocks = self._descend(root, tokens)
        num_same = _common_length(cached_blocks, blocks)
        if num_same < len(cached_blocks):
            return num_same
        if num_same < num_blocks:
            self._add_leaf(node, tokens[num_same * self.block_size :], list(blocks[num_same:num_blocks]))
        return num_blocks

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` unreferenced blocks, least recently used leaves first; returns how
        many blocks left the tree."""
        before = self.num_cached_blocks
        self.allocator.evict_cached(num_blocks)
        return before - self.num_cached_blocks

    def should_retain(self, block_id: int) -> bool:
        """Allocator hook: keep a released block cached iff the tree holds it."""
        return block_id in self._node_of_block

    def on_evict(self, block_id: int) -> None:
        """Allocator hook: the block is being reused, so drop it (and, defensively, anything below it)."""
        node = self._node_of_block.get(block_id)
        if node is None:
            raise CacheIntegrityError(f"the allocator evicted block {block_id}, which the tree does not hold")
        self._truncate(node, node.blocks.index(block_id))

    # --- checking ------------------------------------------------------------------------------------

    def extra_refs(self) -> dict[int, int]:
        """The allocator references the tree holds (its locks), for ``BlockManager.check_integrity``."""
        return {
            block_id: node.lock_count for node in self._nodes() if node.lock_count for block_id in node.blocks
        }

    def check_integrity(self, manager: BlockManager | None = None) -> None:
        """Raise :class:`CacheIntegrityError` if the tree's structure, its locks or its blocks' states
        disagree with each other or with the allocator; with ``manager``, also check that every block's
        refcount is exactly its tables plus the tree's locks. O(tree size + num_blocks)."""
        self.allocator.check_integrity()
        seen = self._check_structure()
        _expect(seen == self._node_of_block.keys(), "the block index and the tree hold different blocks")
        self._check_block_states()
        self._check_release_order()
        if manager is not None:
            _expect(manager.allocator is self.allocator, "the manager has another allocator")
            manager.check_integrity(self.extra_refs())

    # --- internals -----------------------------------------------------------------------------------

    def _root(self, salt: str | None, create: bool) -> RadixNode | None:
        """The root of ``salt``'s tree (made if ``create``; else None while it has none)."""
        if salt is None:
            return self.root
        root = self._salted_roots.get(salt)
        if root is None and create:
            root = self._salted_roots[salt] = RadixNode((), [], None)
            self._salt_of_root[root] = salt
        return root

    def _descend(self, root: RadixNode, tokens: Tokens) -> tuple[RadixNode, list[int]]:
        """The deepest node below ``root`` whose path is a prefix of ``tokens`` (splitting the edge the
        walk stops inside), and that path's blocks."""
        node = root
        blocks: list[int] = []
        while child := node.children.get(self._block_of(tokens, len(blocks))):
            num_same = self._num_matching_blocks(child, tokens, len(blocks))
            if num_same < len(child.blocks):
                child = self._split(child, num_same)
            blocks.extend(child.blocks)
            node = child
        return node, blocks

    def _num_matching_blocks(self, node: RadixNode, tokens: Tokens, first_block: int) -> int:
        for count in range(len(node.blocks)):
            if self._block_of(node.tokens, count) != self._block_of(tokens, first_block + count):
                return count
        return len(node.blocks)

    def _block_of(self, tokens: Tokens, index: int) -> Tokens:
        return tokens[index * self.block_size : (index + 1) * self.block_size]

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``node``'s edge after ``num_blocks`` blocks; the new upper node is returned, and ``node``
        keeps the lower part, so handles to it (a lock's node) still end the same path."""
        parent = node.parent
        assert parent is not None, "the root has no edge to split"
        cut = num_blocks * self.block_size
        upper = RadixNode(node.tokens[:cut], node.blocks[:num_blocks], parent)
        upper.lock_count = node.lock_count
        parent.children[self._block_of(upper.tokens, 0)] = upper
        node.tokens, node.blocks, node.parent = node.tokens[cut:], node.blocks[num_blocks:], upper
        upper.children[self._block_of(node.tokens, 0)] = node
        for block_id in upper.blocks:
            self._node_of_block[block_id] = upper
        return upper

    def _add_leaf(self, parent: RadixNode, tokens: Tokens, blocks: list[int]) -> None:
        self._check_adoptable(blocks)
        leaf = RadixNode(tokens, blocks, parent)
        parent.children[self._block_of(tokens, 0)] = leaf
        for block_id in blocks:
            self._node_of_block[block_id] = leaf

    def _check_adoptable(self, blocks: list[int]) -> None:
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {blocks} name a block twice")
        for block_id in blocks:
            if block_id in self._node_of_block:
                raise ValueError(f"block {block_id} already caches other tokens")
            if self.allocator.refcount(block_id) == 0:
                raise ValueError(f"block {block_id} is not in use; insert only blocks the caller holds")

    def _truncate(self, node: RadixNode, index: int) -> None:
        """Remove ``node.blocks[index:]`` and everything below from the tree. Blocks other than the one
        being evicted are dropped from the allocator's cache if unreferenced, else simply forgotten."""
        removed_blocks = node.blocks[index:]
        for child in node.children.values():
            removed_blocks += self._detach_subtree(child)
        node.children = {}
        if index == 0 and node.parent is not None:
            del node.parent.children[self._block_of(node.tokens, 0)]
            node.attached = False
            self._drop_salted_root_if_empty(node.parent)
        node.tokens, node.blocks = node.tokens[: index * self.block_size], node.blocks[:index]
        for block_id in removed_blocks:
            del self._node_of_block[block_id]
        for block_id in removed_blocks[1:]:
            if self.allocator.is_cached(block_id):
                self.allocator.drop_cached(block_id)
        self.num_evicted_blocks += len(removed_blocks)

    def _drop_salted_root_if_empty(self, node: RadixNode) -> None:
        """Forget a salt whose tree no longer holds a block (no lock can be on a tree without blocks)."""
        if node in self._salt_of_root and not node.children:
            del self._salted_roots[self._salt_of_root.pop(node)]

    def _detach_subtree(self, node: RadixNode) -> list[int]:
        node.attached = False
        blocks = list(node.blocks)
        for child in node.children.values():
            blocks += self._detach_subtree(child)
        return blocks

    def _path_blocks(self, node: RadixNode) -> list[int]:
        if not node.attached:
            return []
        return [block_id for path_node in node.path() for block_id in path_node.blocks]

    def _nodes(self) -> Iterator[RadixNode]:
        stack = [self.root, *self._salted_roots.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_structure(self) -> set[int]:
        """Check edges, keys, parent links and lock counts; returns the blocks the tree holds."""
        seen: set[int] = set()
        for node in self._nodes():
            _expect(node.attached, f"{node!r} is in the tree but marked detached")
            _expect(node.lock_count >= 0, f"{node!r} has a negative lock count")
            child_locks = sum(child.lock_count for child in node.children.values())
            _expect(node.lock_count >= child_locks, f"{node!r} has fewer locks than its children")
            for key, child in node.children.items():
                self._check_edge(node, key, child)
            for block_id in node.blocks:
                _expect(block_id not in seen, f"block {block_id} is in the tree twice")
                _expect(self._node_of_block.get(block_id) is node, f"block {block_id} is indexed wrongly")
                seen.add(block_id)
        return seen

    def _check_edge(self, parent: RadixNode, key: Tokens, child: RadixNode) -> None:
        _expect(child.parent is parent, f"{child!r} does not point back to its parent")
        _expect(bool(child.blocks), f"{child!r} has an empty edge")
        _expect(len(child.tokens) == len(child.blocks) * self.block_size, f"{child!r} has partial blocks")
        _expect(key == self._block_of(child.tokens, 0), f"{child!r} is filed under the wrong key")

    def _check_block_states(self) -> None:
        for node in self._nodes():
            for block_id in node.blocks:
                refcount = self.allocator.refcount(block_id)
                _expect(refcount >= node.lock_count, f"block {block_id} has fewer references than locks")
                is_cached = self.allocator.is_cached(block_id)
                _expect(is_cached == (refcount == 0), f"block {block_id} is unreferenced but not cached")
        for block_id in self.allocator.cached_blocks():
            _expect(block_id in self._node_of_block, f"cached block {block_id} is not in the tree")

    def _check_release_order(self) -> None:
        """Along every path refcounts never grow and cached blocks are due for eviction before the
        cached blocks above them: what makes the allocator's LRU order evict leaves first."""
        eviction_rank = {block_id: rank for rank, block_id in enumerate(self.allocator.cached_blocks())}
        for node in self._nodes():
            for upper, lower in _path_pairs(node):
                upper_refs, lower_refs = self.allocator.refcount(upper), self.allocator.refcount(lower)
                _expect(upper_refs >= lower_refs, f"block {lower} has more references than block {upper}")
                if upper in eviction_rank and lower in eviction_rank:
                    _expect(
                        eviction_rank[lower] < eviction_rank[upper],
                        f"cached block {upper} would be evicted before block {lower} below it",
                    )


def _root_of(node: RadixNode) -> RadixNode:
    while node.parent is not None:
        node = node.parent
    return node


def _path_pairs(node: RadixNode) -> Iterator[tuple[int, int]]:
    """Each pair of consecutive blocks ending in ``node``'s edge (the first pairs with the parent's
    last block)."""
    previous = node.parent.blocks[-1:] if node.parent is not None else []
    chain = previous + node.blocks
    yield from pairwise(chain)


def _common_length(first: Sequence[int], second: Sequence[int]) -> int:
    length = 0
    while length < min(len(first), len(second)) and first[length] == second[length]:
        length += 1
    return length


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CacheIntegrityError(message)
