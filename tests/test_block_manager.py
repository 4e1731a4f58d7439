"""The paged KV cache bookkeeping, checked against naive models written out here.

Every randomized test checks the real structures' own integrity after each operation and compares them
with a plain ownership map, so a bug shows up at the operation that caused it.
"""

import random
import sys
from collections import Counter
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_helpers import gather_kv_cache, make_sequence, naive_slot, slot_of
from tokenmill.attention.torch_backend import write_kv_cache
from tokenmill.cache import (
    BlockAllocator,
    BlockManager,
    CacheIntegrityError,
    NoFreeBlocksError,
    SeqId,
    UnknownSequenceError,
    allocate_kv_pool,
    kv_bytes_per_block,
    kv_bytes_per_token,
    num_blocks_for_budget,
)
from tokenmill.cache.kv_cache_manager import (
    NO_HIT,
    PagedKVCacheManager,
    PrefixCachingKVCacheManager,
    RecomputeKVCacheManager,
    create_kv_cache_manager,
)
from tokenmill.cache.kv_pool import num_blocks_for_device_memory, read_device_memory
from tokenmill.config import SchedulerConfig
from tokenmill.runner.step_inputs import build_step_arrays
from tokenmill.scheduler.output import StepResult
from tokenmill.scheduler.scheduler import Scheduler

STATEFUL = settings(max_examples=60, stateful_step_count=40, deadline=None)


# --- allocator -----------------------------------------------------------------------------------------


def test_allocator_hands_out_every_block_once_then_refuses() -> None:
    allocator = BlockAllocator(4)
    blocks = [allocator.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3]
    assert (allocator.num_free, allocator.num_used) == (0, 4)
    with pytest.raises(NoFreeBlocksError, match="only 0 of 4 are free"):
        allocator.allocate()
    allocator.check_integrity()


def test_allocate_many_is_all_or_nothing() -> None:
    allocator = BlockAllocator(5)
    allocator.allocate_many(3)
    with pytest.raises(NoFreeBlocksError, match="cannot allocate 3 KV block"):
        allocator.allocate_many(3)
    assert allocator.num_free == 2
    allocator.check_integrity()


def test_refcounts_keep_shared_blocks_until_the_last_owner_lets_go() -> None:
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    assert allocator.incref(block) == 2
    assert allocator.decref(block) == 1
    assert allocator.num_free == 1
    assert allocator.decref(block) == 0
    assert allocator.num_free == 2
    allocator.check_integrity()


def test_misuse_of_free_or_unknown_blocks_is_an_error() -> None:
    allocator = BlockAllocator(3)
    with pytest.raises(ValueError, match="double free"):
        allocator.decref(0)
    with pytest.raises(ValueError, match="incref of free block 1"):
        allocator.incref(1)
    with pytest.raises(IndexError, match="out of range"):
        allocator.refcount(3)
    with pytest.raises(ValueError, match="at least one block"):
        BlockAllocator(0)
    allocator.check_integrity()


def test_integrity_check_catches_corruption() -> None:
    allocator = BlockAllocator(3)
    allocator.allocate()
    allocator._free.append(allocator._free[0])
    with pytest.raises(CacheIntegrityError, match="twice"):
        allocator.check_integrity()
    allocator = BlockAllocator(3)
    allocator._refcounts[2] = 1  # used, yet still on the free list
    with pytest.raises(CacheIntegrityError, match="nonzero refcount"):
        allocator.check_integrity()


class RetainEven:
    """A stand-in prefix cache: keeps even-numbered blocks when they are released."""

    def __init__(self) -> None:
        self.evicted: list[int] = []

    def should_retain(self, block_id: int) -> bool:
        return block_id % 2 == 0

    def on_evict(self, block_id: int) -> None:
        self.evicted.append(block_id)


def test_cached_blocks_are_revived_or_evicted_oldest_first() -> None:
    allocator = BlockAllocator(4)
    hook = RetainEven()
    allocator.attach_cache_hook(hook)
    blocks = allocator.allocate_many(4)  # 0, 1, 2, 3
    for block in (2, 0, 1, 3):
        allocator.decref(block)
    assert allocator.num_cached == 2 and allocator.num_free == 4 and allocator.num_used == 0
    assert allocator.incref(0) == 1  # a prefix-cache hit revives it
    assert not allocator.is_cached(0)
    assert {allocator.allocate(), allocator.allocate()} == {1, 3}  # truly free blocks go first
    assert allocator.allocate() == 2 and hook.evicted == [2]
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate()
    allocator.check_integrity()
    assert sorted(blocks) == [0, 1, 2, 3]


def test_detaching_the_hook_evicts_and_drop_cached_frees_silently() -> None:
    allocator = BlockAllocator(4)
    hook = RetainEven()
    allocator.attach_cache_hook(hook)
    for block in allocator.allocate_many(4):
        allocator.decref(block)
    allocator.drop_cached(0)
    assert hook.evicted == [] and allocator.num_cached == 1
    allocator.attach_cache_hook(None)
    assert hook.evicted == [2] and allocator.num_cached == 0 and allocator.num_free == 4
    allocator.check_integrity()


class AllocatorMachine(RuleBasedStateMachine):
    """Refcounts, free and cached sets against a naive model, with a retaining hook attached."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 8
        self.allocator = BlockAllocator(self.total)
        self.hook = RetainEven()
        self.allocator.attach_cache_hook(self.hook)
        self.refs: dict[int, int] = {}  # used block -> refcount
        self.cached: list[int] = []  # in release order

    def free_blocks(self) -> set[int]:
        return set(range(self.total)) - self.refs.keys() - set(self.cached)

    @rule()
    def allocate(self) -> None:
        if not self.free_blocks() and not self.cached:
            with pytest.raises(NoFreeBlocksError):
                self.allocator.allocate()
            return
        expected_free = self.free_blocks()
        block = self.allocator.allocate()
        if expected_free:
            assert block in expected_free
        else:
            assert block == self.cached.pop(0) and self.hook.evicted[-1] == block
        self.refs[block] = 1

    @precondition(lambda self: self.refs or self.cached)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.refs.keys() | set(self.cached))))
        if block in self.cached:
            self.cached.remove(block)
        self.refs[block] = self.refs.get(block, 0) + 1
        assert self.allocator.incref(block) == self.refs[block]

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def decref(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.refs)))
        self.refs[block] -= 1
        assert self.allocator.decref(block) == self.refs[block]
        if self.refs[block] == 0:
            del self.refs[block]
            if self.hook.should_retain(block):
                self.cached.append(block)

    @rule(block=st.integers(0, 7))
    def decref_of_unreferenced_block_fails(self, block: int) -> None:
        if block not in self.refs:
            with pytest.raises(ValueError):
                self.allocator.decref(block)

    @invariant()
    def matches_model(self) -> None:
        self.allocator.check_integrity()
        for block in range(self.total):
            assert self.allocator.refcount(block) == self.refs.get(block, 0)
            assert self.allocator.is_cached(block) == (block in self.cached)
        assert self.allocator.num_used == len(self.refs)
        assert self.allocator.num_free == self.total - len(self.refs)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = STATEFUL


# --- block manager -------------------------------------------------------------------------------------

Range = tuple[SeqId, int, int]  # (sequence, start, end): tokens start:end of that sequence


def slots_of(manager: BlockManager, ranges: SequenceOf[Range]) -> np.ndarray:
    """``manager.slots`` over ``ranges``, each read against its sequence's current table."""
    tables = [manager.table_view(seq_id) for seq_id, _, _ in ranges]
    starts = np.array([start for _, start, _ in ranges], np.int64)
    ends = np.array([end for _, _, end in ranges], np.int64)
    return manager.slots(tables, starts, ends)


def naive_slots(tables: Mapping[Any, list[int]], ranges: SequenceOf[Range], block_size: int) -> list[int]:
    return [naive_slot(tables[s], p, block_size) for s, start, end in ranges for p in range(start, end)]


def test_allocate_grows_tables_and_slots_follow_the_formula() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.allocate("a", 5) == [0, 1]
    assert manager.allocate("a", 8) == []  # still fits in two blocks
    assert manager.allocate("b", 1) == [2]
    assert manager.allocate("a", 9) == [3]
    assert manager.block_table("a") == [0, 1, 3]
    assert slots_of(manager, [("a", 8, 9)]).tolist() == [12]
    assert slots_of(manager, [("a", 2, 10)]).tolist() == [2, 3, 4, 5, 6, 7, 12, 13]
    assert manager.usage() == pytest.approx(4 / 8)
    with pytest.raises(IndexError, match="range 12:13 of row 0 is not within its 12 allocated slots"):
        slots_of(manager, [("a", 12, 13)])
    manager.check_integrity()


def test_block_table_is_a_copy_and_table_view_the_table_itself() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate("a", 3)
    copy, view = manager.block_table("a"), manager.table_view("a")
    copy.append(3)
    assert manager.table_view("a") == [0, 1] and view is manager.table_view("a")
    manager.allocate("a", 5)
    assert view == [0, 1, 2]  # the view follows the table as it grows
    with pytest.raises(UnknownSequenceError):
        manager.table_view("missing")


def test_allocation_under_exhaustion_changes_nothing() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate("a", 5)
    assert manager.blocks_needed("a", 8) == 1 and manager.blocks_needed("a", 2) == 0
    assert manager.blocks_needed("b", 5) == 3 > manager.num_free_blocks
    with pytest.raises(NoFreeBlocksError):
        manager.allocate("b", 5)
    assert "b" not in manager
    with pytest.raises(NoFreeBlocksError):
        manager.allocate("a", 11)
    assert manager.block_table("a") == [0, 1, 2] and manager.num_free_blocks == 1
    manager.check_integrity()


def test_free_returns_blocks_and_unknown_ids_are_rejected_without_change() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate(7, 3)
    manager.free(7)
    assert manager.num_free_blocks == 4
    with pytest.raises(UnknownSequenceError, match="7"):
        manager.free(7)
    with pytest.raises(UnknownSequenceError):
        manager.block_table("missing")
    manager.check_integrity()


def test_shared_prefix_holds_one_reference_per_table() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    manager.allocate("parent", 5)
    prefix = manager.block_table("parent")[:2]
    manager.share_prefix("child", prefix)
    manager.allocate("child", 6)
    assert manager.block_table("child")[:2] == prefix
    assert [manager.allocator.refcount(b) for b in prefix] == [2, 2]
    manager.check_integrity()
    manager.free("parent")
    assert [manager.allocator.refcount(b) for b in prefix] == [1, 1]
    with pytest.raises(ValueError, match="already has blocks"):
        manager.share_prefix("child", prefix)
    with pytest.raises(ValueError, match="is free"):
        manager.share_prefix("other", [5])
    manager.check_integrity()
    with pytest.raises(CacheIntegrityError, match="refcount 1 but 2"):
        manager.check_integrity(extra_refs={prefix[0]: 1})


def test_truncate_releases_the_blocks_past_the_kept_ones_last_first() -> None:
    manager = BlockManager(num_blocks=5, block_size=2)
    manager.allocate("a", 8)
    manager.share_prefix("b", manager.block_table("a")[:2])
    manager.truncate("a", 4)
    manager.truncate("a", 6)  # keeping more than it has changes nothing
    assert manager.block_table("a") == [0, 1, 2, 3] and manager.num_free_blocks == 1
    manager.truncate("a", 1)
    assert manager.block_table("a") == [0]
    assert [manager.allocator.refcount(b) for b in range(5)] == [2, 1, 0, 0, 0]  # b still holds block 1
    assert manager.num_free_blocks == 3
    manager.check_integrity()
    # Released last first: blocks 3 then 2 joined the free list behind block 4, never used.
    assert manager.allocate("c", 6) == [4, 3, 2]
    manager.truncate("a", 0)
    assert "a" in manager and manager.block_table("a") == [] and manager.allocator.refcount(0) == 1
    with pytest.raises(ValueError, match="non-negative"):
        manager.truncate("b", -1)
    with pytest.raises(UnknownSequenceError):
        manager.truncate("missing", 0)
    assert manager.block_table("b") == [0, 1]
    manager.free("c")  # also last block first
    assert manager.allocate("a", 3) == [2, 3]  # a truncated table grows again
    manager.check_integrity()


def test_padded_tables_pad_with_block_zero() -> None:
    manager = BlockManager(num_blocks=8, block_size=2)
    manager.allocate("x", 2)
    manager.allocate("y", 7)
    manager.allocate("x", 4)
    manager.allocate("z", 0)
    tables = [manager.table_view(seq_id) for seq_id in ("y", "x", "z")]
    padded = manager.padded_tables(tables, np.int32)
    assert padded.dtype == np.int32
    assert padded.tolist() == [[1, 2, 3, 4], [0, 5, 0, 0], [0, 0, 0, 0]]
    wide = manager.padded_tables(tables[1:2], np.int64, width=3)
    assert wide.dtype == np.int64 and wide.tolist() == [[0, 5, 0]]
    assert manager.padded_tables([], np.int32).shape == (0, 0)
    with pytest.raises(ValueError, match="narrower"):
        manager.padded_tables(tables[:1], np.int32, width=3)


def test_slots_pack_ranges_in_order() -> None:
    manager = BlockManager(num_blocks=8, block_size=3)
    manager.allocate("x", 4)
    manager.allocate("y", 7)
    ranges: list[Range] = [("y", 5, 7), ("x", 0, 4), ("y", 2, 2), ("x", 3, 4)]
    slots = slots_of(manager, ranges)
    tables = {seq_id: manager.block_table(seq_id) for seq_id in "xy"}
    assert slots.dtype == np.int64 and slots.tolist() == naive_slots(tables, ranges, 3)
    assert slots_of(manager, []).tolist() == []
    with pytest.raises(IndexError, match="range 5:7 of row 1 is not within its 6 allocated slots"):
        slots_of(manager, [("y", 0, 1), ("x", 5, 7)])
    for bad in [("x", 3, 2), ("x", -1, 2)]:
        with pytest.raises(IndexError):
            slots_of(manager, [bad])


class ManagerModel:
    """The naive model: an explicit table per sequence and a holder count per block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self.known: set[int] = {-1}  # every id the manager has seen, and one it never has

    def holders(self) -> Counter[int]:
        return Counter(block for table in self.tables.values() for block in table)

    def num_free(self) -> int:
        return self.num_blocks - len(self.holders())

    def check(self, manager: BlockManager) -> None:
        manager.check_integrity()
        for seq_id in self.known:
            assert (seq_id in manager) == (seq_id in self.tables), seq_id
        for seq_id, table in self.tables.items():
            assert manager.block_table(seq_id) == table == manager.table_view(seq_id)
            assert len(set(table)) == len(table)
        holders = self.holders()
        for block in range(self.num_blocks):
            assert manager.allocator.refcount(block) == holders[block]
        assert manager.num_free_blocks == self.num_free()


def random_operation(manager: BlockManager, model: ManagerModel, rng: random.Random) -> None:
    op = rng.random()
    live = sorted(model.tables)
    if op < 0.4 or not live:
        seq_id = rng.choice([*live, max(live, default=-1) + 1])
        grow_to(manager, model, seq_id, rng.randint(0, 6 * model.block_size))
    elif op < 0.6:
        seq_id = rng.choice(live)
        manager.free(seq_id)
        del model.tables[seq_id]
    elif op < 0.7:
        share_full_blocks(manager, model, rng.choice(live), max(live) + 1, rng)
    elif op < 0.8:
        seq_id = rng.choice(live)
        truncate_to(manager, model, seq_id, rng.randint(0, len(model.tables[seq_id]) + 1))
    elif op < 0.87:
        with pytest.raises(UnknownSequenceError):
            manager.free(max(live) + 1)
    else:
        check_slots(manager, model, rng)


def grow_to(manager: BlockManager, model: ManagerModel, seq_id: int, total_tokens: int) -> None:
    have = model.tables.get(seq_id, [])
    needed = max(0, -(-total_tokens // model.block_size) - len(have))
    assert manager.blocks_needed(seq_id, total_tokens) == needed
    if needed > model.num_free():
        with pytest.raises(NoFreeBlocksError):
            manager.allocate(seq_id, total_tokens)
        return
    new_blocks = manager.allocate(seq_id, total_tokens)
    assert len(new_blocks) == needed
    assert not set(new_blocks) & set(model.holders()), "a block was handed out while owned"
    model.tables[seq_id] = [*have, *new_blocks]
    model.known.add(seq_id)


def share_full_blocks(
    manager: BlockManager, model: ManagerModel, parent: int, child: int, rng: random.Random
) -> None:
    prefix = model.tables[parent][: rng.randint(0, len(model.tables[parent]))]
    manager.share_prefix(child, prefix)
    model.tables[child] = list(prefix)
    model.known.add(child)


def truncate_to(manager: BlockManager, model: ManagerModel, seq_id: int, num_blocks: int) -> None:
    manager.truncate(seq_id, num_blocks)
    model.tables[seq_id] = model.tables[seq_id][:num_blocks]


def check_slots(manager: BlockManager, model: ManagerModel, rng: random.Random) -> None:
    ranges: list[tuple[int, int, int]] = []
    for seq_id, table in model.tables.items():
        capacity = len(table) * model.block_size
        start = rng.randint(0, capacity)
        ranges.append((seq_id, start, rng.randint(start, capacity)))
    rng.shuffle(ranges)
    assert slots_of(manager, ranges).tolist() == naive_slots(model.tables, ranges, model.block_size)
    for one in ranges:
        assert slots_of(manager, [one]).tolist() == naive_slots(model.tables, [one], model.block_size)
    if ranges:  # one token past a sequence's last block
        last, _, _ = ranges[-1]
        capacity = len(model.tables[last]) * model.block_size
        with pytest.raises(IndexError, match="not within its"):
            slots_of(manager, [*ranges[:-1], (last, capacity, capacity + 1)])
        with pytest.raises(IndexError, match="not within its"):  # one sequence alone
            slots_of(manager, [(last, capacity, capacity + 1)])
    tables = manager.padded_tables([manager.table_view(seq_id) for seq_id in model.tables], np.int32)
    width = max((len(t) for t in model.tables.values()), default=0)
    assert tables.tolist() == [t + [0] * (width - len(t)) for t in model.tables.values()]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("num_blocks", "block_size"), [(16, 4), (64, 1), (5, 16)])
def test_random_operations_match_the_naive_model(seed: int, num_blocks: int, block_size: int) -> None:
    rng = random.Random(seed)
    manager = BlockManager(num_blocks, block_size)
    model = ManagerModel(num_blocks, block_size)
    for _ in range(300):
        random_operation(manager, model, rng)
        model.check(manager)
    for seq_id in list(model.tables):
        manager.free(seq_id)
        del model.tables[seq_id]
        model.check(manager)
    assert manager.num_free_blocks == num_blocks and manager.usage() == 0


SEQ_IDS = range(6)


class ManagerMachine(RuleBasedStateMachine):
    """The same model driven by hypothesis, which shrinks any failure to a short sequence of steps."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(num_blocks=10, block_size=3)
        self.model = ManagerModel(num_blocks=10, block_size=3)
        self.model.known.update(SEQ_IDS)

    @rule(seq_id=st.sampled_from(SEQ_IDS), total_tokens=st.integers(0, 20))
    def allocate(self, seq_id: int, total_tokens: int) -> None:
        grow_to(self.manager, self.model, seq_id, total_tokens)

    @rule(seq_id=st.sampled_from(SEQ_IDS))
    def free(self, seq_id: int) -> None:
        if seq_id in self.model.tables:
            self.manager.free(seq_id)
            del self.model.tables[seq_id]
        else:
            with pytest.raises(UnknownSequenceError):
                self.manager.free(seq_id)

    @rule(seq_id=st.sampled_from(SEQ_IDS), num_blocks=st.integers(0, 8))
    def truncate(self, seq_id: int, num_blocks: int) -> None:
        if seq_id in self.model.tables:
            truncate_to(self.manager, self.model, seq_id, num_blocks)
        else:
            with pytest.raises(UnknownSequenceError):
                self.manager.truncate(seq_id, num_blocks)

    def empty_ids(self) -> list[int]:
        return [s for s in SEQ_IDS if not self.model.tables.get(s)]

    @precondition(lambda self: self.model.tables and self.empty_ids())
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.model.tables)))
        child = data.draw(st.sampled_from(self.empty_ids()))
        share_full_blocks(self.manager, self.model, parent, child, random.Random(data.draw(st.integers())))

    @rule(seed=st.integers())
    def slots(self, seed: int) -> None:
        check_slots(self.manager, self.model, random.Random(seed))

    @invariant()
    def matches_model(self) -> None:
        self.model.check(self.manager)

    def teardown(self) -> None:
        for seq_id in list(self.model.tables):
            self.manager.free(seq_id)
        self.manager.check_integrity()
        assert self.manager.allocator.num_used == 0


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = STATEFUL


# --- KV cache managers (what the scheduler calls) -------------------------------------------------------


def test_create_kv_cache_manager_picks_the_mode() -> None:
    assert isinstance(create_kv_cache_manager("none", 0, 1, False), RecomputeKVCacheManager)
    paged = create_kv_cache_manager("paged", 4, 2, False)
    assert type(paged) is PagedKVCacheManager and (paged.blocks.num_blocks, paged.block_size) == (4, 2)
    assert isinstance(create_kv_cache_manager("paged", 4, 2, True), PrefixCachingKVCacheManager)


def test_paged_manager_allocates_all_or_nothing_keeping_blocks_free_on_request() -> None:
    kv = PagedKVCacheManager(num_blocks=6, block_size=4)
    a, b = make_sequence("a", range(9)), make_sequence("b", range(3))
    assert kv.match(a) == NO_HIT
    assert kv.blocks_needed(a, 9) == 3 and kv.allocate(a, 9)
    assert kv.block_table(a) == [0, 1, 2] and (kv.num_free_blocks, kv.num_used_blocks) == (3, 3)
    assert not kv.allocate(b, 12, keep_free=1)  # its 3 blocks would leave none free
    assert not kv.allocate(b, 13)  # 4 blocks: more than are free
    assert "b" not in kv.blocks and kv.num_free_blocks == 3
    assert kv.allocate(b, 8, keep_free=1) and kv.num_free_blocks == 1
    assert kv.allocate(a, 5) and kv.block_table(a) == [0, 1, 2]  # asking for fewer shrinks nothing
    assert kv.blocks_needed(a, 13) == 1 and kv.blocks_for_tokens(13) == 4
    assert kv.capacity_tokens == 24 and kv.usage() == pytest.approx(5 / 6) and kv.tokens_kept(7) == 7
    kv.check_integrity()
    kv.free(a)
    kv.free(a)  # holds nothing now: a no-op
    assert kv.num_free_blocks == 4 and kv.num_used_blocks == 2
    kv.check_integrity()


def test_paging_arrays_match_the_naive_slots_and_tables() -> None:
    kv = PagedKVCacheManager(num_blocks=16, block_size=4)
    seqs = [make_sequence(name, range(n)) for name, n in (("a", 9), ("b", 3), ("c", 14))]
    for seq in reversed(seqs):  # interleave allocation so tables are not contiguous runs
        kv.allocate(seq, 2)
    for seq in seqs:
        kv.allocate(seq, seq.num_tokens)
    starts, ends = np.array([8, 0, 5]), np.array([9, 3, 14])
    arrays = kv.paging_arrays(seqs, starts, ends, width=6)
    expected = [
        slot_of(kv, seq, p)
        for seq, start, end in zip(seqs, starts, ends, strict=True)
        for p in range(start, end)
    ]
    assert arrays["slot_mapping"].dtype == np.int64 and arrays["slot_mapping"].tolist() == expected
    tables = [kv.block_table(seq) for seq in seqs]
    assert arrays["block_tables"].dtype == np.int32
    assert arrays["block_tables"].tolist() == [table + [0] * (6 - len(table)) for table in tables]
    assert kv.paging_arrays(seqs, starts, ends)["block_tables"].shape == (3, 4)


def test_rollback_returns_the_blocks_past_the_kept_tokens() -> None:
    kv = PagedKVCacheManager(num_blocks=6, block_size=4)
    seq, other = make_sequence("s", range(5)), make_sequence("o", range(5))
    kv.allocate(seq, 13)
    assert kv.block_table(seq) == [0, 1, 2, 3]
    kv.rollback(seq, 0)
    kv.rollback(seq, 1)  # 12 tokens: three full blocks
    assert kv.block_table(seq) == [0, 1, 2] and kv.num_free_blocks == 3
    kv.rollback(seq, 3)  # 9 tokens: still three blocks
    assert kv.block_table(seq) == [0, 1, 2]
    kv.rollback(seq, 2)  # 7 tokens
    assert kv.block_table(seq) == [0, 1] and kv.num_free_blocks == 4
    for too_many in (8, -1):
        with pytest.raises(ValueError, match="cannot roll back"):
            kv.rollback(seq, too_many)
    assert kv.block_table(seq) == [0, 1]
    assert kv.blocks_needed(seq, 8) == 0 and kv.blocks_needed(seq, 9) == 1
    assert kv.allocate(other, 4) and kv.block_table(other) == [4]
    kv.rollback(seq, 7)  # nothing left, but still known
    assert kv.block_table(seq) == [] and kv.num_free_blocks == 5
    with pytest.raises(ValueError, match="cannot roll back 1 of the 0 slots"):
        kv.rollback(seq, 1)
    assert kv.allocate(seq, 2) and len(kv.block_table(seq)) == 1
    kv.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_random_allocate_rollback_free_match_a_token_count_model(seed: int) -> None:
    """Each sequence holds the leading ceil(tokens / block_size) blocks of its table; a rollback keeps a
    prefix of the table, an allocation extends it."""
    rng = random.Random(seed)
    num_blocks, block_size = 12, 3
    kv = PagedKVCacheManager(num_blocks, block_size)
    seqs = [make_sequence(f"s{i}", [1]) for i in range(4)]
    held: dict[str, int] = {}  # tokens with slots, per sequence holding a table
    tables: dict[str, list[int]] = {}
    rollbacks = refusals = 0
    for _ in range(400):
        seq = rng.choice(seqs)
        have = held.get(seq.seq_id, 0)
        free = num_blocks - sum(len(table) for table in tables.values())
        roll = rng.random()
        if roll < 0.45 or seq.seq_id not in held:
            num_tokens, keep_free = rng.randint(0, 20), rng.randint(0, 2)
            needed = max(0, -(-num_tokens // block_size) - len(tables.get(seq.seq_id, [])))
            fits = needed + keep_free <= free
            assert kv.allocate(seq, num_tokens, keep_free) == fits
            if fits:
                table = kv.block_table(seq)
                assert table[: len(tables.get(seq.seq_id, []))] == tables.get(seq.seq_id, [])
                held[seq.seq_id], tables[seq.seq_id] = max(have, num_tokens), table
        elif roll < 0.85:
            count = rng.randint(0, have + 1)
            if count > have:
                with pytest.raises(ValueError):
                    kv.rollback(seq, count)
                refusals += 1
            else:
                kv.rollback(seq, count)
                held[seq.seq_id] = have - count
                tables[seq.seq_id] = tables[seq.seq_id][: -(-(have - count) // block_size)]
                rollbacks += 1
        else:
            kv.free(seq)
            held.pop(seq.seq_id, None)
            tables.pop(seq.seq_id, None)
        kv.check_integrity()
        for held_seq in seqs:
            if held_seq.seq_id in tables:
                table = tables[held_seq.seq_id]
                assert kv.block_table(held_seq) == table
                assert len(table) == -(-held[held_seq.seq_id] // block_size)
        assert kv.num_free_blocks == num_blocks - sum(len(table) for table in tables.values())
    assert rollbacks > 50 and refusals > 5


def test_recompute_manager_admits_everything_and_keeps_nothing() -> None:
    kv = RecomputeKVCacheManager()
    seq = make_sequence("a", range(100))
    assert kv.match(seq) == NO_HIT
    assert kv.allocate(seq, 10**9, keep_free=10**6)
    assert kv.blocks_needed(seq, 10**9) == kv.blocks_for_tokens(10**9) == 0
    assert kv.num_free_blocks == kv.num_used_blocks == 0 and kv.usage() == 0.0
    assert kv.tokens_kept(1234) == 0  # every step recomputes the sequence from its first token
    assert kv.capacity_tokens == sys.maxsize
    assert kv.paging_arrays([seq], np.array([0]), np.array([100])) == {}
    kv.cache_full_blocks(seq)
    kv.rollback(seq, 5)
    kv.free(seq)
    kv.free(seq)
    kv.check_integrity()


def test_without_a_cache_every_step_recomputes_each_sequence_from_its_first_token() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = Scheduler(config, RecomputeKVCacheManager(), max_model_len=64)
    seqs = [make_sequence(f"s{i}", range(3 + 5 * i), max_tokens=4) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    for step in range(4):
        out = scheduler.schedule()
        assert [(c.seq, c.start, c.end) for c in out.chunks] == [(s, 0, s.num_tokens) for s in seqs], step
        arrays = build_step_arrays(out.chunks, scheduler.kv)
        assert "slot_mapping" not in arrays and "block_tables" not in arrays
        scheduler.update(out, StepResult(sampled={seq: [(7, None)] for seq in seqs}))
        assert all(seq.num_computed_tokens == 0 for seq in seqs)
    assert all(seq.is_finished and seq.num_output_tokens == 4 for seq in seqs)
    assert not scheduler.has_unfinished


def test_a_batch_step_orders_its_rows_longest_context_first() -> None:
    """``seq_order`` (the order decode attention launches a batch's sequences in): rows by context length,
    longest first, ties in row order, padding rows (graphs) last."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)
    scheduler = Scheduler(config, PagedKVCacheManager(num_blocks=64, block_size=4), max_model_len=64)
    lengths = [5, 17, 9, 17, 2]
    for i, length in enumerate(lengths):
        scheduler.add(make_sequence(f"s{i}", range(length), max_tokens=4))
    chunks = scheduler.schedule().chunks
    arrays = build_step_arrays(chunks, scheduler.kv, num_rows=7)
    ends = [chunk.end for chunk in chunks]
    assert sorted(ends) == sorted(lengths)
    expected = [*sorted(range(len(ends)), key=lambda row: -ends[row]), 5, 6]
    assert arrays["seq_order"].tolist() == expected
    assert build_step_arrays(chunks[:1], scheduler.kv)["seq_order"].tolist() == [0]


# --- KV pool -------------------------------------------------------------------------------------------


def test_kv_pool_shapes_are_zeroed_and_layers_independent() -> None:
    pool = allocate_kv_pool(3, 5, 4, 2, 8, torch.bfloat16, "cpu")
    assert len(pool) == 3
    for layer in pool:
        for tensor in (layer.key, layer.value):
            assert tensor.shape == (5, 4, 2, 8) and tensor.dtype == torch.bfloat16
            assert tensor.is_contiguous() and not tensor.any()
        assert layer.block_size == 4
    pool[0].key.fill_(1)
    assert not pool[0].value.any() and not pool[1].key.any()
    with pytest.raises(ValueError, match="num_blocks must be at least 1"):
        allocate_kv_pool(3, 0, 4, 2, 8, torch.float32, "cpu")


def test_kv_bytes_and_budget() -> None:
    per_token = kv_bytes_per_token(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    assert per_token == 2 * 4 * 2 * 64 * 2
    per_block = kv_bytes_per_block(16, 4, 2, 64, torch.float16)
    assert per_block == 16 * per_token
    assert num_blocks_for_budget(10 * per_block + per_block - 1, 16, 4, 2, 64, torch.float16) == 10
    pool = allocate_kv_pool(4, 10, 16, 2, 64, torch.float16, "cpu")
    assert (
        sum(t.numel() * t.element_size() for layer in pool for t in (layer.key, layer.value))
        == 10 * per_block
    )
    with pytest.raises(ValueError, match=rf"budget of {per_block - 1} bytes .* block of {per_block} bytes"):
        num_blocks_for_budget(per_block - 1, 16, 4, 2, 64, torch.float16)


def num_blocks_from_gpu_memory(utilization: float, *shape: Any, reserve_bytes: int = 0) -> int:
    return num_blocks_for_device_memory(
        read_device_memory(), utilization, *shape, reserve_bytes=reserve_bytes
    )


def _fraction_of_an_indexed_device(device: object) -> float:
    """As ``torch.cuda.get_per_process_memory_fraction`` does, refuse a device without an index."""
    if not isinstance(device, int):
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
    return 1.0


def test_num_blocks_from_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1024**3
    per_block = kv_bytes_per_block(16, 4, 2, 64, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 8 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 8 * gib)  # nothing handed back
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", _fraction_of_an_indexed_device)
    args = (16, 4, 2, 64, torch.bfloat16)
    assert num_blocks_from_gpu_memory(0.5, *args) == (40 - 8) * gib // per_block
    for device in ("cuda", torch.device("cuda"), "cuda:0", 0):  # torch's call wants an index
        assert read_device_memory(device) == read_device_memory()
    assert num_blocks_from_gpu_memory(1.0, *args) == 70 * gib // per_block  # capped by free memory
    assert num_blocks_from_gpu_memory(0.5, *args, reserve_bytes=gib) == 31 * gib // per_block
    with pytest.raises(ValueError, match=r"0.1 x 80.00 GiB total, .* - 8.00 GiB used by this process"):
        num_blocks_from_gpu_memory(0.1, *args)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.5)
    assert num_blocks_from_gpu_memory(0.5, *args) == (20 - 8) * gib // per_block  # of its 40 GiB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        num_blocks_from_gpu_memory(1.5, *args)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="num_blocks_for_budget"):
        num_blocks_from_gpu_memory(0.5, *args)


def test_slots_and_tables_address_the_pool_the_way_attention_reads_it() -> None:
    """K/V written through the slot mapping come back, per sequence and in order, through the tables."""
    torch.manual_seed(0)
    block_size, heads, dim = 4, 2, 3
    manager = BlockManager(num_blocks=12, block_size=block_size)
    (pool,) = allocate_kv_pool(1, 12, block_size, heads, dim, torch.float32, "cpu")
    lengths = {"a": 9, "b": 3, "c": 14}
    keys = {seq: torch.randn(n, heads, dim) for seq, n in lengths.items()}
    for seq in ("b", "a", "c"):  # interleave allocation so tables are not contiguous runs
        manager.allocate(seq, 2)
    for seq, n in lengths.items():
        manager.allocate(seq, n)
    ranges: list[Range] = [(seq, 0, n) for seq, n in lengths.items()]
    packed = torch.cat([keys[seq] for seq in lengths])
    slots = torch.from_numpy(slots_of(manager, ranges))
    assert slots.tolist() == naive_slots({s: manager.block_table(s) for s in lengths}, ranges, block_size)
    write_kv_cache(pool, packed, packed, slots)
    tables = manager.padded_tables([manager.table_view(seq) for seq in lengths], np.int32)
    gathered = gather_kv_cache(pool.key, torch.from_numpy(tables), max(lengths.values()))
    for row, (seq, n) in enumerate(lengths.items()):
        torch.testing.assert_close(gathered[row, :n], keys[seq])


def test_growing_within_held_blocks_takes_nothing_but_counts_the_slots() -> None:
    """Most decode steps need a slot in a block the sequence holds already: nothing is taken, yet the
    slots count for a later rollback; ``keep_free`` is still honoured."""
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    seq = make_sequence("s", range(5))
    assert kv.allocate(seq, 5) and kv.block_table(seq) == [0, 1]
    free = kv.num_free_blocks
    assert kv.allocate(seq, 8) and kv.block_table(seq) == [0, 1] and kv.num_free_blocks == free
    assert kv.allocate(seq, 6)  # fewer than it holds: nothing changes
    assert not kv.allocate(seq, 8, keep_free=free + 1)  # as when blocks are needed
    kv.rollback(seq, 8)  # all 8 slots are held, so all can be given back
    assert kv.block_table(seq) == [] and kv.num_free_blocks == 4
    kv.check_integrity()
