"""The radix prefix cache, checked against a naive model written out here.

The model is a dict from block-aligned token prefixes to block ids, a holder count per block and an
explicit eviction list. Randomized runs drive tree and model the way a scheduler would (admit: match,
lock, share, allocate; compute: insert; finish or preempt: unlock, free; plus explicit evictions) and
compare them, with every integrity check, after each operation.
"""

import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kv_helpers import make_sequence, naive_slot
from tokenmill.cache import BlockAllocator, BlockManager, CacheIntegrityError, NoFreeBlocksError
from tokenmill.cache.kv_cache_manager import PrefixCachingKVCacheManager
from tokenmill.cache.radix_cache import PrefixMatch, RadixCache, RadixNode
from tokenmill.sequence import Sequence

Tokens = tuple[int, ...]


def make_cache(num_blocks: int, block_size: int) -> tuple[BlockManager, RadixCache]:
    manager = BlockManager(num_blocks, block_size)
    return manager, RadixCache(manager.allocator, manager.block_size)


def tree_contents(cache: RadixCache) -> dict[Tokens, int]:
    """Every block-aligned prefix the tree caches, and its block."""
    contents: dict[Tokens, int] = {}
    stack: list[tuple[RadixNode, Tokens]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for index, block_id in enumerate(node.blocks):
            contents[prefix + node.tokens[: (index + 1) * cache.block_size]] = block_id
        stack.extend((child, prefix + node.tokens) for child in node.children.values())
    return contents


def admit(manager: BlockManager, cache: RadixCache, seq_id: str, prompt: list[int]) -> PrefixMatch:
    """The scheduler recipe for one request that is known to fit."""
    match = cache.match_prefix(prompt)
    cache.lock(match)
    manager.share_prefix(seq_id, match.blocks)
    manager.allocate(seq_id, len(prompt))
    return match


def finish(manager: BlockManager, cache: RadixCache, seq_id: str, match: PrefixMatch) -> None:
    cache.unlock(match.node)
    manager.free(seq_id)


def run_to_cache(manager: BlockManager, cache: RadixCache, seq_id: str, prompt: list[int]) -> list[int]:
    """Admit, compute and insert ``prompt``, then finish: its full blocks stay cached. Returns them."""
    match = admit(manager, cache, seq_id, prompt)
    table = manager.block_table(seq_id)
    cache.insert(prompt, table)
    finish(manager, cache, seq_id, match)
    cache.check_integrity(manager)
    return table[: len(prompt) // cache.block_size]


# --- matching, insertion and splits --------------------------------------------------------------------


def test_match_of_a_fully_cached_prompt_leaves_its_last_token() -> None:
    manager, cache = make_cache(8, 4)
    prompt = list(range(8))
    blocks = run_to_cache(manager, cache, "a", prompt)
    match = cache.match_prefix(prompt)
    assert (match.blocks, match.num_tokens, match.num_query_tokens) == (tuple(blocks[:1]), 4, 8)
    longer = cache.match_prefix([*prompt, 99])
    assert (longer.blocks, longer.num_tokens) == (tuple(blocks), 8)
    assert cache.num_free_after_lock(longer) == manager.num_free_blocks - 2
    cache.check_integrity(manager)


@pytest.mark.parametrize("prompt", [[], [0], [0, 1, 2], [0, 1, 2, 3]])
def test_a_prompt_of_at_most_one_block_matches_nothing(prompt: list[int]) -> None:
    manager, cache = make_cache(8, 4)
    run_to_cache(manager, cache, "a", list(range(12)))
    match = cache.match_prefix(prompt)
    assert (match.blocks, match.num_tokens, match.node) == ((), 0, cache.root)
    cache.lock(match)
    cache.unlock(match.node)
    cache.check_integrity(manager)


def test_insert_and_match_split_edges_where_they_diverge_or_stop() -> None:
    manager, cache = make_cache(16, 2)
    first = run_to_cache(manager, cache, "a", [1, 1, 2, 2, 3, 3, 4, 4])
    (edge,) = cache.root.children.values()
    assert edge.blocks == first  # one edge of four blocks
    second = run_to_cache(manager, cache, "b", [1, 1, 2, 2, 9, 9])
    (upper,) = cache.root.children.values()
    assert upper.blocks == first[:2] and sorted(len(c.blocks) for c in upper.children.values()) == [1, 2]
    assert tree_contents(cache)[(1, 1, 2, 2, 9, 9)] == second[2]
    match = cache.match_prefix([1, 1, 2, 2, 3, 3, 7])  # stops inside the [3 3, 4 4] edge: split there
    assert match.blocks == tuple(first[:3]) and match.node.blocks == [first[2]]
    assert [len(node.blocks) for node in match.node.path()] == [2, 1]
    cache.check_integrity(manager)


def test_a_locked_node_split_later_still_unlocks_its_whole_path() -> None:
    manager, cache = make_cache(16, 2)
    blocks = run_to_cache(manager, cache, "a", [5, 5, 6, 6, 7, 7, 8])
    match = cache.match_prefix([5, 5, 6, 6, 7, 7, 8])
    cache.lock(match)
    assert [manager.allocator.refcount(b) for b in blocks] == [1, 1, 1]
    cache.match_prefix([5, 5, 6, 0])  # splits the locked edge after its first block
    assert len(match.node.path()) == 2 and match.node.path()[0].lock_count == 1
    cache.check_integrity(manager)
    cache.unlock(match.node)
    assert manager.allocator.cached_blocks() == blocks[::-1]  # released deepest first
    cache.check_integrity(manager)


def test_insert_keeps_existing_blocks_and_reports_what_it_owns() -> None:
    manager, cache = make_cache(16, 2)
    prompt = [1, 2, 3, 4, 5, 6]
    table_a, table_b, table_c = (manager.allocate(seq, 6) for seq in "abc")
    assert cache.insert(prompt[:4], table_a) == 2
    assert cache.insert(prompt, table_a) == 3  # the first two are touched, the third added
    assert cache.insert(prompt, table_b) == 0  # duplicates: the tree keeps a's blocks
    assert cache.insert([1, 2, 3], table_b) == 0  # the partial block is ignored, the full one a duplicate
    assert cache.insert([7, 7, 1], table_c) == 1  # other tokens: a new child of the root
    assert tree_contents(cache) == {
        (1, 2): table_a[0],
        (1, 2, 3, 4): table_a[1],
        (1, 2, 3, 4, 5, 6): table_a[2],
        (7, 7): table_c[0],
    }
    cache.check_integrity(manager)


def test_insert_rejects_blocks_it_cannot_adopt() -> None:
    manager, cache = make_cache(8, 2)
    manager.allocate("a", 4)
    table = manager.block_table("a")
    with pytest.raises(ValueError, match="only 1 given"):
        cache.insert([1, 2, 3, 4], table[:1])
    with pytest.raises(ValueError, match="twice"):
        cache.insert([1, 2, 3, 4], [table[0], table[0]])
    with pytest.raises(ValueError, match="not in use"):
        cache.insert([1, 2], [7])
    cache.insert([1, 2], table)
    with pytest.raises(ValueError, match="already caches other tokens"):
        cache.insert([3, 3], table)
    cache.check_integrity(manager)


# --- locks, preemption and eviction --------------------------------------------------------------------


def test_locks_are_extra_references_the_manager_check_needs() -> None:
    manager, cache = make_cache(8, 2)
    blocks = run_to_cache(manager, cache, "a", [1, 2, 3, 4, 5])
    match = admit(manager, cache, "b", [1, 2, 3, 4, 5])
    assert cache.extra_refs() == dict.fromkeys(blocks, 1)
    with pytest.raises(CacheIntegrityError, match="refcount 2 but 1"):
        manager.check_integrity()
    manager.check_integrity(cache.extra_refs())
    finish(manager, cache, "b", match)
    with pytest.raises(ValueError, match="double unlock"):
        cache.unlock(match.node)
    assert cache.extra_refs() == {}


def test_a_hit_then_preemption_leaves_the_prefix_cached_and_matchable() -> None:
    manager, cache = make_cache(8, 2)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    blocks = run_to_cache(manager, cache, "a", prompt)
    match = admit(manager, cache, "b", prompt)
    assert match.blocks == tuple(blocks) and match.num_tokens == 6
    assert manager.block_table("b")[:3] == blocks
    assert [manager.allocator.refcount(b) for b in blocks] == [2, 2, 2]  # b's table and b's lock
    cache.check_integrity(manager)
    finish(manager, cache, "b", match)  # preempted
    assert manager.allocator.num_used == 0 and manager.allocator.cached_blocks() == blocks[::-1]
    again = cache.match_prefix(prompt)
    assert again.blocks == match.blocks
    cache.check_integrity(manager)


def test_allocator_exhaustion_evicts_unlocked_leaves_lru_and_never_locked_ones() -> None:
    manager, cache = make_cache(7, 2)
    old = run_to_cache(manager, cache, "old", [1, 1, 2, 2, 3])
    new = run_to_cache(manager, cache, "new", [5, 5, 6, 6, 7])
    assert manager.allocator.cached_blocks() == [old[1], old[0], new[1], new[0]]
    pinned = admit(manager, cache, "pinned", [1, 1, 2, 2, 3])  # locks old's path
    assert manager.num_free_blocks == 4  # 2 free, new's 2 cached
    manager.allocate("filler", 6)  # 3 blocks: both free ones, then new's leaf
    assert not tree_contents(cache).keys() & {(5, 5, 6, 6)} and (5, 5) in tree_contents(cache)
    cache.check_integrity(manager)
    manager.allocate("filler", 8)
    assert tree_contents(cache).keys() == {(1, 1), (1, 1, 2, 2)}
    with pytest.raises(NoFreeBlocksError):
        manager.allocate("filler", 10)
    assert cache.num_cached_blocks == 2 and cache.num_evicted_blocks == 2
    finish(manager, cache, "pinned", pinned)
    assert cache.evict(5) == 2 and cache.num_cached_blocks == 0
    cache.check_integrity(manager)


def test_identical_prompts_share_blocks_once_one_is_cached() -> None:
    manager, cache = make_cache(10, 2)
    prompt = [4, 4, 5, 5, 6]
    first = admit(manager, cache, "a", prompt)
    cache.insert(prompt, manager.block_table("a"))
    second = admit(manager, cache, "b", prompt)
    shared = manager.block_table("a")[:2]
    assert second.blocks == tuple(shared) and manager.block_table("b")[:2] == shared
    assert [manager.allocator.refcount(b) for b in shared] == [3, 3]  # two tables and b's lock
    assert manager.allocator.num_used == 4
    cache.check_integrity(manager)
    finish(manager, cache, "a", first)
    finish(manager, cache, "b", second)
    assert manager.allocator.cached_blocks() == shared[::-1]
    cache.check_integrity(manager)


def test_identical_prompts_admitted_together_keep_one_copy_cached() -> None:
    manager, cache = make_cache(10, 2)
    prompt = [4, 4, 5, 5, 6]
    first, second = (admit(manager, cache, seq, prompt) for seq in "ab")
    assert first.blocks == second.blocks == ()  # neither was cached yet
    assert cache.insert(prompt, manager.block_table("a")) == 2
    assert cache.insert(prompt, manager.block_table("b")) == 0
    cache.check_integrity(manager)
    finish(manager, cache, "b", second)  # b's duplicates go straight back to the free list
    finish(manager, cache, "a", first)
    assert manager.allocator.num_cached == 2 and manager.num_free_blocks == 10
    assert cache.match_prefix(prompt).blocks == tuple(cached_blocks_for(cache, prompt))
    cache.check_integrity(manager)


def cached_blocks_for(cache: RadixCache, prompt: list[int]) -> list[int]:
    contents = tree_contents(cache)
    size = cache.block_size
    return [contents[tuple(prompt[: (i + 1) * size])] for i in range((len(prompt) - 1) // size)]


def test_a_match_made_stale_by_eviction_cannot_be_locked() -> None:
    manager, cache = make_cache(4, 2)
    run_to_cache(manager, cache, "a", [1, 1, 2, 2, 3])
    match = cache.match_prefix([1, 1, 2, 2, 3])
    assert cache.evict(1) == 1
    with pytest.raises(ValueError, match="stale prefix match"):
        cache.lock(match)
    cache.check_integrity(manager)


def test_each_cache_salt_has_a_tree_of_its_own() -> None:
    """vLLM's ``cache_salt``: the same tokens cached under one salt are found under that salt only (and the
    unsalted tree only unsalted); locks and checks cover every tree, and a salt whose blocks are all evicted
    is forgotten."""
    manager, cache = make_cache(16, 4)
    prompt = list(range(13))
    cached: dict[str | None, tuple[int, ...]] = {}
    for salt in ("a", "b", None):
        assert cache.match_prefix(prompt, salt).blocks == ()  # not even another salt's blocks
        manager.allocate(f"seq-{salt}", len(prompt))
        table = manager.block_table(f"seq-{salt}")
        assert cache.insert(prompt, table, salt) == 3
        manager.free(f"seq-{salt}")
        cached[salt] = tuple(table[:3])
        cache.check_integrity(manager)
    assert len(set(cached.values())) == 3
    assert {salt: cache.match_prefix(prompt, salt).blocks for salt in cached} == cached
    hit = admit(manager, cache, "reader", [*prompt[:8], 99])  # unsalted, locked while it reads
    assert hit.blocks == cached[None][:2]
    assert cache.evict(16) == 7  # both salts' blocks and the unsalted third block
    assert cache.match_prefix(prompt, "a").blocks == () and cache._salted_roots == {}
    cache.check_integrity(manager)
    finish(manager, cache, "reader", hit)
    cache.check_integrity(manager)


def test_integrity_check_catches_corruption() -> None:
    manager, cache = make_cache(8, 2)
    run_to_cache(manager, cache, "a", [1, 1, 2, 2, 3])
    (node,) = cache.root.children.values()
    node.lock_count = 1
    with pytest.raises(CacheIntegrityError, match="fewer locks than its children"):
        cache.check_integrity()
    cache.root.lock_count = 1
    with pytest.raises(CacheIntegrityError, match="fewer references than locks"):
        cache.check_integrity()
    node.lock_count = cache.root.lock_count = 0
    cache.check_integrity(manager)
    cache.root.children[(9, 9)] = cache.root.children.pop((1, 1))
    with pytest.raises(CacheIntegrityError, match="wrong key"):
        cache.check_integrity()


def test_releasing_a_parent_before_its_child_is_flagged_and_eviction_copes() -> None:
    """Outside the usage contract (a holder of a block holds its whole path, releasing it deepest
    first) eviction could reach a block with descendants; it then drops the whole subtree."""
    allocator = BlockAllocator(4)
    cache = RadixCache(allocator, 2)
    upper, lower = allocator.allocate_many(2)
    assert cache.insert([1, 2, 3, 4], [upper, lower]) == 2
    allocator.decref(upper)
    with pytest.raises(CacheIntegrityError, match="more references"):
        cache.check_integrity()
    allocator.decref(lower)
    with pytest.raises(CacheIntegrityError, match="evicted before"):
        cache.check_integrity()
    assert cache.evict(1) == 2
    assert allocator.num_free == 4 and cache.num_cached_blocks == 0 and cache.root.children == {}
    cache.check_integrity()


def test_eviction_of_a_parent_forgets_children_still_in_use() -> None:
    allocator = BlockAllocator(4)
    cache = RadixCache(allocator, 2)
    upper, lower = allocator.allocate_many(2)
    cache.insert([1, 2, 3, 4], [upper, lower])
    allocator.decref(upper)
    assert cache.evict(1) == 2 and allocator.refcount(lower) == 1
    allocator.decref(lower)  # no longer the tree's: freed, not cached
    assert allocator.num_cached == 0 and allocator.num_free == 4
    cache.check_integrity()


# --- randomized, against the naive model ---------------------------------------------------------------


class PrefixModel:
    """Naive prefix cache: prefix -> block, holders per block, free set and eviction list."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.cached: dict[Tokens, int] = {}
        self.holders: Counter[int] = Counter()
        self.free = set(range(num_blocks))
        self.lru: list[int] = []  # unreferenced cached blocks, next to be evicted first
        self.queries = self.query_tokens = self.hit_tokens = 0

    def key(self, tokens: list[int], num_blocks: int) -> Tokens:
        return tuple(tokens[: num_blocks * self.block_size])

    def match(self, tokens: list[int]) -> list[int]:
        blocks: list[int] = []
        while len(blocks) < (len(tokens) - 1) // self.block_size:
            block = self.cached.get(self.key(tokens, len(blocks) + 1))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def free_after_taking(self, blocks: list[int]) -> int:
        return len(self.free) + len(self.lru) - sum(block in self.lru for block in blocks)

    def take(self, block: int) -> None:
        if self.holders[block] == 0:
            self.lru.remove(block)
        self.holders[block] += 1

    def release(self, block: int) -> None:
        self.holders[block] -= 1
        if self.holders[block] == 0:
            del self.holders[block]
            (self.lru.append if block in self.cached.values() else self.free.add)(block)

    def allocated(self, block: int) -> None:
        """The allocator handed out ``block``: a free one if any, else the eviction list's head."""
        if self.free:
            assert block in self.free
            self.free.remove(block)
        else:
            assert block == self.lru.pop(0)
            self.forget(block)
        self.holders[block] = 1

    def evict(self, count: int) -> int:
        victims, self.lru = self.lru[:count], self.lru[count:]
        for block in victims:
            self.forget(block)
            self.free.add(block)
        return len(victims)

    def forget(self, block: int) -> None:
        (key,) = [key for key, cached in self.cached.items() if cached == block]
        assert not any(len(other) > len(key) and other[: len(key)] == key for other in self.cached)
        del self.cached[key]

    def insert(self, tokens: list[int], blocks: list[int]) -> int:
        num_blocks = len(tokens) // self.block_size
        for index in range(num_blocks):
            cached = self.cached.get(self.key(tokens, index + 1))
            if cached is None:
                self.cached.update({self.key(tokens, i + 1): blocks[i] for i in range(index, num_blocks)})
                return num_blocks
            if cached != blocks[index]:
                return index
        return num_blocks

    def check(self, manager: BlockManager, cache: RadixCache) -> None:
        cache.check_integrity(manager)
        assert tree_contents(cache) == self.cached
        assert manager.allocator.cached_blocks() == self.lru
        for block in range(manager.num_blocks):
            assert manager.allocator.refcount(block) == self.holders[block]
        assert cache.num_cached_blocks == len(self.cached)


@dataclass
class Running:
    tokens: list[int]
    computed: int
    match: PrefixMatch
    table: list[int] = field(default_factory=list)


class Driver:
    """Scheduler-like use of manager + cache, mirrored step by step in the model."""

    def __init__(self, num_blocks: int, block_size: int, vocab: int) -> None:
        self.manager, self.cache = make_cache(num_blocks, block_size)
        self.model = PrefixModel(num_blocks, block_size)
        self.vocab = vocab
        self.running: dict[int, Running] = {}
        self.next_id = 0
        base_rng = random.Random(vocab)
        self.documents = [[base_rng.randrange(vocab) for _ in range(6 * block_size)] for _ in range(3)]

    def prompt(self, rng: random.Random) -> list[int]:
        document = rng.choice(self.documents)[: rng.randint(0, 6 * self.model.block_size)]
        return document + [
            rng.randrange(self.vocab) for _ in range(rng.randint(0, 2 * self.model.block_size))
        ]

    def step(self, rng: random.Random) -> None:
        roll = rng.random()
        if roll < 0.3 or not self.running:
            self.admit(self.prompt(rng))
        elif roll < 0.55:
            self.compute(rng.choice(list(self.running)))
        elif roll < 0.7:
            self.decode(rng.choice(list(self.running)), rng.randrange(self.vocab))
        elif roll < 0.88:
            self.finish(rng.choice(list(self.running)), unlock_first=rng.random() < 0.5)
        elif roll < 0.94:
            self.evict(rng.randint(0, 3))
        else:
            self.probe(self.prompt(rng))

    def probe(self, tokens: list[int]) -> PrefixMatch:
        match = self.cache.match_prefix(tokens)
        expected = self.model.match(tokens)
        assert list(match.blocks) == expected and match.num_tokens == len(expected) * self.model.block_size
        return match

    def admit(self, tokens: list[int]) -> None:
        match = self.probe(tokens)
        needed = self.manager.blocks_for_tokens(len(tokens)) - len(match.blocks)
        free_after = self.cache.num_free_after_lock(match)
        assert free_after == self.model.free_after_taking(list(match.blocks))
        if needed > free_after:
            return
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.cache.lock(match)
        self.manager.share_prefix(seq_id, match.blocks)
        for block in match.blocks * 2:  # the lock's reference and the table's
            self.model.take(block)
        self.model.queries += 1
        self.model.query_tokens += len(tokens)
        self.model.hit_tokens += match.num_tokens
        for block in self.manager.allocate(seq_id, len(tokens)):
            self.model.allocated(block)
        self.running[seq_id] = Running(tokens, match.num_tokens, match, self.manager.block_table(seq_id))

    def compute(self, seq_id: int) -> None:
        request = self.running[seq_id]
        request.computed = len(request.tokens)
        owned = self.cache.insert(request.tokens, request.table)
        assert owned == self.model.insert(request.tokens, request.table)

    def decode(self, seq_id: int, token: int) -> None:
        request = self.running[seq_id]
        if request.computed < len(request.tokens):
            return
        if self.manager.blocks_needed(seq_id, len(request.tokens) + 1) > self.manager.num_free_blocks:
            return
        request.tokens.append(token)
        for block in self.manager.allocate(seq_id, len(request.tokens)):
            self.model.allocated(block)
        request.table = self.manager.block_table(seq_id)

    def finish(self, seq_id: int, unlock_first: bool) -> None:
        request = self.running.pop(seq_id)
        steps = [self.unlock, self.free]
        for step in steps if unlock_first else steps[::-1]:
            step(seq_id, request)

    def unlock(self, seq_id: int, request: Running) -> None:
        self.cache.unlock(request.match.node)
        for block in reversed(request.match.blocks):
            self.model.release(block)

    def free(self, seq_id: int, request: Running) -> None:
        self.manager.free(seq_id)
        for block in reversed(request.table):
            self.model.release(block)

    def evict(self, count: int) -> None:
        assert self.cache.evict(count) == self.model.evict(count)

    def finish_all(self) -> None:
        for seq_id in list(self.running):
            self.finish(seq_id, unlock_first=True)
            self.check()
        assert self.manager.allocator.num_used == 0
        assert self.manager.allocator.num_cached == self.cache.num_cached_blocks

    def check(self) -> None:
        self.model.check(self.manager, self.cache)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("num_blocks", "block_size", "vocab"), [(12, 2, 2), (24, 1, 3), (10, 4, 2), (40, 3, 3)]
)
def test_random_scheduler_use_matches_the_naive_model(
    seed: int, num_blocks: int, block_size: int, vocab: int
) -> None:
    rng = random.Random(seed)
    driver = Driver(num_blocks, block_size, vocab)
    for _ in range(300):
        driver.step(rng)
        driver.check()
    driver.finish_all()
    assert driver.model.queries > 0 and driver.model.hit_tokens > 0


class RadixMachine(RuleBasedStateMachine):
    """The same driver under hypothesis, which shrinks a failure to a short sequence of operations."""

    def __init__(self) -> None:
        super().__init__()
        self.driver = Driver(num_blocks=10, block_size=2, vocab=2)

    @rule(seed=st.integers(0, 2**16))
    def admit(self, seed: int) -> None:
        self.driver.admit(self.driver.prompt(random.Random(seed)))

    @rule(pick=st.integers(0, 9))
    def compute(self, pick: int) -> None:
        if self.driver.running:
            self.driver.compute(sorted(self.driver.running)[pick % len(self.driver.running)])

    @rule(pick=st.integers(0, 9), token=st.integers(0, 1))
    def decode(self, pick: int, token: int) -> None:
        if self.driver.running:
            self.driver.decode(sorted(self.driver.running)[pick % len(self.driver.running)], token)

    @rule(pick=st.integers(0, 9), unlock_first=st.booleans())
    def finish(self, pick: int, unlock_first: bool) -> None:
        if self.driver.running:
            self.driver.finish(sorted(self.driver.running)[pick % len(self.driver.running)], unlock_first)

    @rule(count=st.integers(0, 4))
    def evict(self, count: int) -> None:
        self.driver.evict(count)

    @rule(seed=st.integers(0, 2**16))
    def probe(self, seed: int) -> None:
        self.driver.probe(self.driver.prompt(random.Random(seed)))

    @invariant()
    def matches_model(self) -> None:
        self.driver.check()

    def teardown(self) -> None:
        self.driver.finish_all()


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)


# --- end to end: a miniature scheduler with a fake KV pool ---------------------------------------------


@dataclass(eq=False)
class Request:
    seq_id: str
    tokens: list[int]
    max_tokens: int
    computed: int = 0
    generated: int = 0
    prefix_node: RadixNode | None = None


class MiniScheduler:
    """The module docstring's recipe, with a KV pool whose slot for token ``p`` must always hold the
    prefix ``tokens[: p + 1]`` it was computed from: a wrongly shared or prematurely evicted block shows."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.manager, self.cache = make_cache(num_blocks, block_size)
        self.kv: dict[int, Tokens] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.query_tokens = self.hit_tokens = 0

    def step(self) -> None:
        self.admit_waiting()
        for request in list(self.running):
            if request in self.running:
                self.run(request)
        self.cache.check_integrity(self.manager)

    def admit_waiting(self) -> None:
        while self.waiting:
            request = self.waiting[0]
            match = self.cache.match_prefix(request.tokens)
            new_blocks = self.manager.blocks_for_tokens(len(request.tokens)) - len(match.blocks)
            if new_blocks > self.cache.num_free_after_lock(match):
                return
            self.cache.lock(match)
            self.query_tokens += len(request.tokens)
            self.hit_tokens += match.num_tokens
            self.manager.share_prefix(request.seq_id, match.blocks)
            self.manager.allocate(request.seq_id, len(request.tokens))
            request.computed, request.prefix_node = match.num_tokens, match.node
            self.running.append(self.waiting.popleft())

    def run(self, request: Request) -> None:
        self.compute(request)
        request.tokens.append(hash((request.seq_id, request.generated)) % 3)  # "sample"
        request.generated += 1
        if request.generated == request.max_tokens:
            self.release(request)
            return
        while self.manager.blocks_needed(request.seq_id, len(request.tokens)) > self.manager.num_free_blocks:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return
        self.manager.allocate(request.seq_id, len(request.tokens))

    def compute(self, request: Request) -> None:
        for position in range(request.computed):  # what attention would read from the cache
            assert self.kv[self.slot(request, position)] == tuple(request.tokens[: position + 1])
        for position in range(request.computed, len(request.tokens)):
            self.kv[self.slot(request, position)] = tuple(request.tokens[: position + 1])
        blocks_before = request.computed // self.cache.block_size
        request.computed = len(request.tokens)
        if request.computed // self.cache.block_size > blocks_before:
            self.cache.insert(request.tokens, self.manager.block_table(request.seq_id))

    def slot(self, request: Request, position: int) -> int:
        return naive_slot(self.manager.block_table(request.seq_id), position, self.cache.block_size)

    def preempt(self, request: Request) -> None:
        self.release(request)
        request.computed = 0
        self.waiting.appendleft(request)
        self.preemptions += 1

    def release(self, request: Request) -> None:
        assert request.prefix_node is not None
        self.cache.unlock(request.prefix_node)
        self.manager.free(request.seq_id)
        self.running.remove(request)


def test_scheduler_simulation_shares_prefixes_and_keeps_kv_consistent() -> None:
    rng = random.Random(0)
    scheduler = MiniScheduler(num_blocks=24, block_size=4)
    system_prompts = [[rng.randrange(3) for _ in range(13)] for _ in range(2)]
    requests = [
        Request(f"r{i}", rng.choice(system_prompts) + [rng.randrange(3) for _ in range(rng.randint(0, 6))], 8)
        for i in range(30)
    ]
    for request in requests:
        scheduler.waiting.append(request)
        scheduler.step()
    while scheduler.running or scheduler.waiting:
        scheduler.step()
    assert all(request.generated == request.max_tokens for request in requests)
    cache, allocator = scheduler.cache, scheduler.manager.allocator
    assert scheduler.hit_tokens > 0.5 * scheduler.query_tokens
    assert scheduler.preemptions > 0 and cache.num_evicted_blocks > 0  # the pool was under pressure
    assert allocator.num_used == 0 and allocator.num_cached == cache.num_cached_blocks > 0
    cache.check_integrity(scheduler.manager)


# --- the prefix-caching KV cache manager (what the scheduler calls) ------------------------------------


def test_prefix_manager_shares_a_cached_prefix_and_frees_consistently() -> None:
    kv = PrefixCachingKVCacheManager(num_blocks=5, block_size=2)
    first = make_sequence("first", [1, 1, 2, 2, 3])
    miss = kv.match(first)
    assert (miss.num_tokens, miss.num_query_tokens, miss.match) == (0, 5, None)
    assert kv.allocate(first, 5, prefix=miss) and len(kv.block_table(first)) == 3
    first.num_computed_tokens = 5
    kv.cache_full_blocks(first)
    prefix = kv.block_table(first)[:2]
    assert tree_contents(kv.tree) == {(1, 1): prefix[0], (1, 1, 2, 2): prefix[1]}
    kv.check_integrity()
    second = make_sequence("second", [1, 1, 2, 2, 3, 4])
    hit = kv.match(second)
    assert (hit.num_tokens, hit.num_query_tokens) == (4, 6) and hit.match and list(hit.match.blocks) == prefix
    assert not kv.allocate(second, 6, keep_free=2, prefix=hit)  # 1 new block would leave 1 of 2 free
    assert [kv.blocks.allocator.refcount(b) for b in prefix] == [1, 1] and "second" not in kv.blocks
    assert kv.tree.extra_refs() == {}
    assert kv.allocate(second, 6, keep_free=1, prefix=hit)
    assert kv.block_table(second)[:2] == prefix and kv.num_free_blocks == 1
    assert [kv.blocks.allocator.refcount(b) for b in prefix] == [3, 3]  # two tables and second's lock
    kv.check_integrity()
    kv.free(first)
    kv.free(second)
    kv.free(second)  # holds nothing now: a no-op
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 5
    assert kv.blocks.allocator.cached_blocks() == prefix[::-1]  # kept, for the next hit
    kv.check_integrity()
    third = make_sequence("third", [1, 1, 2, 2, 5, 5, 6])
    again = kv.match(third)
    assert again.match and list(again.match.blocks) == prefix
    # Reviving the two cached blocks leaves 3 free: the 2 new blocks fit only with keep_free <= 1.
    assert not kv.allocate(third, 7, keep_free=2, prefix=again)
    assert kv.allocate(third, 7, keep_free=1, prefix=again) and kv.num_free_blocks == 1
    kv.check_integrity()


def test_prefix_manager_refuses_to_roll_back_into_blocks_it_cached() -> None:
    kv = PrefixCachingKVCacheManager(num_blocks=8, block_size=2)
    seq = make_sequence("s", [1, 1, 2, 2, 3])
    assert kv.allocate(seq, 5)
    seq.num_computed_tokens = 5
    kv.cache_full_blocks(seq)  # blocks 0 and 1 (tokens 0..3) are in the tree
    assert kv.allocate(seq, 8)  # slots for three more tokens (say, speculative ones)
    table = kv.block_table(seq)
    assert len(table) == 4
    kv.rollback(seq, 3)  # back to the 5 computed tokens
    assert kv.block_table(seq) == table[:3]
    kv.rollback(seq, 1)  # 4 tokens: exactly the cached blocks
    assert kv.block_table(seq) == table[:2]
    with pytest.raises(ValueError, match="prefix cache"):
        kv.rollback(seq, 1)
    assert kv.block_table(seq) == table[:2] and tree_contents(kv.tree)[(1, 1, 2, 2)] == table[1]
    kv.check_integrity()
    kv.free(seq)
    kv.check_integrity()


def test_prefix_manager_refuses_to_roll_back_into_a_shared_prefix() -> None:
    kv = PrefixCachingKVCacheManager(num_blocks=8, block_size=2)
    first = make_sequence("first", [1, 1, 2, 2, 3])
    assert kv.allocate(first, 5)
    first.num_computed_tokens = 5
    kv.cache_full_blocks(first)
    kv.free(first)
    second = make_sequence("second", [1, 1, 2, 2, 3])
    hit = kv.match(second)
    assert hit.num_tokens == 4 and kv.allocate(second, 5, prefix=hit)
    second.num_computed_tokens = hit.num_tokens  # what admission does; nothing computed yet
    table = kv.block_table(second)
    with pytest.raises(ValueError, match="prefix cache"):
        kv.rollback(second, 3)  # would leave 2 tokens: into the shared (cached) block of tokens 2..3
    assert kv.block_table(second) == table


@dataclass(eq=False)
class Admitted:
    seq: Sequence
    shared: tuple[int, ...]  # the cached blocks its admission locked (none on a miss)
    table: list[int]
    inserted: int = 0  # full blocks offered to the tree


class ManagerDriver:
    """Scheduler-like use of ``PrefixCachingKVCacheManager`` through its own calls (match, allocate with
    keep_free, cache_full_blocks, rollback, free), mirrored step by step in the naive model."""

    def __init__(self, num_blocks: int, block_size: int, vocab: int) -> None:
        self.kv = PrefixCachingKVCacheManager(num_blocks, block_size)
        self.model = PrefixModel(num_blocks, block_size)
        self.block_size = block_size
        self.prompts = Driver(num_blocks, block_size, vocab)  # its prompt generator
        self.running: dict[str, Admitted] = {}
        self.next_id = 0
        self.refused_rollbacks = 0

    def step(self, rng: random.Random) -> None:
        roll = rng.random()
        names = sorted(self.running)
        if roll < 0.3 or not names:
            self.admit([*self.prompts.prompt(rng), 0], keep_free=rng.choice([0, 0, 1, 3]))
        elif roll < 0.5:
            self.compute(self.running[rng.choice(names)])
        elif roll < 0.65:
            self.decode(self.running[rng.choice(names)], rng.randrange(self.prompts.vocab), rng.randint(1, 3))
        elif roll < 0.78:
            self.rollback(self.running[rng.choice(names)], rng)
        elif roll < 0.93:
            self.free(self.running.pop(rng.choice(names)))
        else:
            count = rng.randint(0, 3)
            assert self.kv.tree.evict(count) == self.model.evict(count)

    def admit(self, tokens: list[int], keep_free: int) -> None:
        seq = make_sequence(f"s{self.next_id}", tokens)
        self.next_id += 1
        hit = self.kv.match(seq)
        expected = self.model.match(tokens)
        shared = hit.match.blocks if hit.match is not None else ()
        assert list(shared) == expected and hit.num_query_tokens == len(tokens)
        assert hit.num_tokens == len(expected) * self.block_size
        needed = -(-len(tokens) // self.block_size) - len(expected)
        fits = needed + keep_free <= self.model.free_after_taking(expected)
        assert self.kv.allocate(seq, len(tokens), keep_free, hit) == fits
        if not fits:
            return  # nothing taken: the model's check says so
        for block in expected * 2:  # the lock's reference and the table's
            self.model.take(block)
        if expected:  # the tree counts locked matches; a miss takes no lock
            self.model.queries += 1
            self.model.query_tokens += len(tokens)
            self.model.hit_tokens += hit.num_tokens
        table = self.kv.block_table(seq)
        assert table[: len(expected)] == expected
        for block in table[len(expected) :]:
            self.model.allocated(block)
        seq.num_computed_tokens = hit.num_tokens
        self.running[seq.seq_id] = Admitted(seq, tuple(expected), table)

    def compute(self, admitted: Admitted) -> None:
        seq = admitted.seq
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_full_blocks(seq)
        full_blocks = seq.num_tokens // self.block_size
        if full_blocks > admitted.inserted:
            self.model.insert(seq.token_ids[: full_blocks * self.block_size], admitted.table)
            admitted.inserted = full_blocks

    def decode(self, admitted: Admitted, token: int, count: int) -> None:
        """Append ``count`` tokens (a sampled one, or speculative ones) and give them slots."""
        seq = admitted.seq
        if seq.num_computed_tokens < seq.num_tokens:
            return
        total = seq.num_tokens + count
        if self.kv.blocks_needed(seq, total) > len(self.model.free) + len(self.model.lru):
            return
        seq.token_ids.extend([token] * count)
        assert self.kv.allocate(seq, total)
        new_blocks = self.kv.block_table(seq)[len(admitted.table) :]
        for block in new_blocks:
            self.model.allocated(block)
        admitted.table += new_blocks

    def rollback(self, admitted: Admitted, rng: random.Random) -> None:
        """Give back uncomputed tokens (rejected speculative ones), or try to cut into cached blocks."""
        seq = admitted.seq
        cached_tokens = admitted.inserted * self.block_size
        if rng.random() < 0.7 or cached_tokens == 0:
            count = rng.randint(0, seq.num_tokens - seq.num_computed_tokens)
        else:
            count = rng.randint(seq.num_tokens - cached_tokens + 1, seq.num_tokens)
        if seq.num_tokens - count < cached_tokens:
            with pytest.raises(ValueError, match="prefix cache"):
                self.kv.rollback(seq, count)
            self.refused_rollbacks += 1
            return
        self.kv.rollback(seq, count)
        kept = -(-(seq.num_tokens - count) // self.block_size)
        for block in reversed(admitted.table[kept:]):
            self.model.release(block)
        del admitted.table[kept:]
        del seq.token_ids[seq.num_tokens - count :]

    def free(self, admitted: Admitted) -> None:
        self.kv.free(admitted.seq)
        for block in reversed(admitted.shared):  # the lock goes first, then the table
            self.model.release(block)
        for block in reversed(admitted.table):
            self.model.release(block)

    def check(self) -> None:
        self.kv.check_integrity()
        self.model.check(self.kv.blocks, self.kv.tree)
        for admitted in self.running.values():
            assert self.kv.block_table(admitted.seq) == admitted.table
        assert self.kv.num_free_blocks == len(self.model.free) + len(self.model.lru)
        assert self.kv.num_used_blocks == len(self.model.holders)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("num_blocks", "block_size", "vocab"), [(12, 2, 2), (20, 3, 3)])
def test_prefix_manager_calls_match_the_naive_model(
    seed: int, num_blocks: int, block_size: int, vocab: int
) -> None:
    rng = random.Random(seed)
    driver = ManagerDriver(num_blocks, block_size, vocab)
    for _ in range(300):
        driver.step(rng)
        driver.check()
    for name in sorted(driver.running):
        driver.free(driver.running.pop(name))
        driver.check()
    assert driver.kv.num_used_blocks == 0 and driver.kv.num_free_blocks == num_blocks
    assert driver.model.hit_tokens > 0 and driver.refused_rollbacks > 0
