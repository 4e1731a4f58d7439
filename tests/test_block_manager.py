"""The paged KV cache bookkeeping, checked against naive models written out here.

Every randomized test checks the real structures' own integrity after each operation and compares them
with a plain ownership map, so a bug shows up at the operation that caused it.
"""

import random
from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.attention.torch_backend import gather_kv_cache, write_kv_cache
from tokenmill.cache import (
    BlockAllocator,
    BlockManager,
    CacheIntegrityError,
    NoFreeBlocksError,
    TokenRange,
    UnknownSequenceError,
    allocate_kv_pool,
    kv_bytes_per_block,
    kv_bytes_per_token,
    num_blocks_for_budget,
    num_blocks_from_gpu_memory,
)

STATEFUL = settings(max_examples=60, stateful_step_count=40, deadline=None)


def naive_slot(table: list[int], position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


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


def test_allocate_grows_tables_and_slots_follow_the_formula() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.allocate("a", 5) == [0, 1]
    assert manager.allocate("a", 8) == []  # still fits in two blocks
    assert manager.allocate("b", 1) == [2]
    assert manager.allocate("a", 9) == [3]
    assert manager.block_table("a") == [0, 1, 3]
    assert manager.slot("a", 8) == 12
    assert manager.slot_mapping("a", 2, 10) == [2, 3, 4, 5, 6, 7, 12, 13]
    assert manager.capacity("a") == 12
    assert manager.usage() == pytest.approx(4 / 8)
    with pytest.raises(IndexError, match="outside its 3 block"):
        manager.slot("a", 12)
    manager.check_integrity()


def test_allocation_under_exhaustion_changes_nothing() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate("a", 5)
    assert manager.blocks_needed("a", 8) == 1 and manager.can_allocate(8, "a")
    assert manager.blocks_needed("b", 5) == 3 and not manager.can_allocate(5)
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


def test_build_block_tables_pads_with_block_zero() -> None:
    manager = BlockManager(num_blocks=8, block_size=2)
    manager.allocate("x", 2)
    manager.allocate("y", 7)
    manager.allocate("x", 4)
    manager.allocate("z", 0)
    tables = manager.build_block_tables(["y", "x", "z"])
    assert tables.dtype == torch.int32
    assert tables.tolist() == [[1, 2, 3, 4], [0, 5, 0, 0], [0, 0, 0, 0]]
    assert manager.build_block_tables(["x"], width=3).tolist() == [[0, 5, 0]]
    assert manager.build_block_tables([]).shape == (0, 0)
    with pytest.raises(ValueError, match="narrower"):
        manager.build_block_tables(["y"], width=3)


def test_build_slot_mapping_packs_ranges_in_order() -> None:
    manager = BlockManager(num_blocks=8, block_size=3)
    manager.allocate("x", 4)
    manager.allocate("y", 7)
    ranges = [TokenRange("y", 5, 7), ("x", 0, 4), ("y", 2, 2), ("x", 3, 4)]
    slots = manager.build_slot_mapping(ranges)
    expected = [
        naive_slot(manager.block_table(s), p, 3) for s, start, end in ranges for p in range(start, end)
    ]
    assert slots.dtype == torch.int64 and slots.tolist() == expected
    assert manager.build_slot_mapping([]).tolist() == []
    with pytest.raises(IndexError, match="range 5:7 of sequence 'x'"):
        manager.build_slot_mapping([("y", 0, 1), ("x", 5, 7)])
    with pytest.raises(IndexError):
        manager.slot_mapping("x", 3, 2)


class ManagerModel:
    """The naive model: an explicit table per sequence and a holder count per block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}

    def holders(self) -> Counter[int]:
        return Counter(block for table in self.tables.values() for block in table)

    def num_free(self) -> int:
        return self.num_blocks - len(self.holders())

    def check(self, manager: BlockManager) -> None:
        manager.check_integrity()
        assert manager.seq_ids() == list(self.tables)
        for seq_id, table in self.tables.items():
            assert manager.block_table(seq_id) == table
            assert len(set(table)) == len(table)
        holders = self.holders()
        for block in range(self.num_blocks):
            assert manager.allocator.refcount(block) == holders[block]
        assert manager.num_free_blocks == self.num_free()


def random_operation(manager: BlockManager, model: ManagerModel, rng: random.Random) -> None:
    op = rng.random()
    live = sorted(model.tables)
    if op < 0.45 or not live:
        seq_id = rng.choice([*live, max(live, default=-1) + 1])
        grow_to(manager, model, seq_id, rng.randint(0, 6 * model.block_size))
    elif op < 0.7:
        seq_id = rng.choice(live)
        manager.free(seq_id)
        del model.tables[seq_id]
    elif op < 0.8:
        share_full_blocks(manager, model, rng.choice(live), max(live) + 1, rng)
    elif op < 0.9:
        with pytest.raises(UnknownSequenceError):
            manager.free(max(live) + 1)
    else:
        check_slots(manager, model, rng)


def grow_to(manager: BlockManager, model: ManagerModel, seq_id: int, total_tokens: int) -> None:
    have = model.tables.get(seq_id, [])
    needed = max(0, -(-total_tokens // model.block_size) - len(have))
    assert manager.blocks_needed(seq_id, total_tokens) == needed
    if needed > model.num_free():
        assert not manager.can_allocate(total_tokens, seq_id)
        with pytest.raises(NoFreeBlocksError):
            manager.allocate(seq_id, total_tokens)
        return
    new_blocks = manager.allocate(seq_id, total_tokens)
    assert len(new_blocks) == needed
    assert not set(new_blocks) & set(model.holders()), "a block was handed out while owned"
    model.tables[seq_id] = [*have, *new_blocks]


def share_full_blocks(
    manager: BlockManager, model: ManagerModel, parent: int, child: int, rng: random.Random
) -> None:
    prefix = model.tables[parent][: rng.randint(0, len(model.tables[parent]))]
    manager.share_prefix(child, prefix)
    model.tables[child] = list(prefix)


def check_slots(manager: BlockManager, model: ManagerModel, rng: random.Random) -> None:
    ranges = []
    for seq_id, table in model.tables.items():
        capacity = len(table) * model.block_size
        start = rng.randint(0, capacity)
        ranges.append((seq_id, start, rng.randint(start, capacity)))
    expected = [
        naive_slot(model.tables[s], p, model.block_size)
        for s, start, end in ranges
        for p in range(start, end)
    ]
    assert manager.build_slot_mapping(ranges).tolist() == expected
    for seq_id, start, end in ranges:
        assert manager.slot_mapping(seq_id, start, end) == [
            naive_slot(model.tables[seq_id], p, model.block_size) for p in range(start, end)
        ]
    tables = manager.build_block_tables(list(model.tables)).tolist()
    width = max((len(t) for t in model.tables.values()), default=0)
    assert tables == [t + [0] * (width - len(t)) for t in model.tables.values()]


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
        assert self.manager.num_used_blocks == 0


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = STATEFUL


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


def test_num_blocks_from_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1024**3
    per_block = kv_bytes_per_block(16, 4, 2, 64, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 8 * gib)
    args = (16, 4, 2, 64, torch.bfloat16)
    assert num_blocks_from_gpu_memory(0.5, *args) == (40 - 8) * gib // per_block
    assert num_blocks_from_gpu_memory(1.0, *args) == 70 * gib // per_block  # capped by free memory
    assert num_blocks_from_gpu_memory(0.5, *args, reserve_bytes=gib) == 31 * gib // per_block
    with pytest.raises(ValueError, match=r"0.1 x 80.00 GiB total - 8.00 GiB used by this process"):
        num_blocks_from_gpu_memory(0.1, *args)
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
    ranges = [(seq, 0, n) for seq, n in lengths.items()]
    packed = torch.cat([keys[seq] for seq in lengths])
    write_kv_cache(pool, packed, packed, manager.build_slot_mapping(ranges))
    gathered = gather_kv_cache(pool.key, manager.build_block_tables(list(lengths)), max(lengths.values()))
    for row, (seq, n) in enumerate(lengths.items()):
        torch.testing.assert_close(gathered[row, :n], keys[seq])
