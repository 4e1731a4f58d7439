"""The push all-reduce kernel (``kernels/push_all_reduce.py``) on CPU in Triton's interpreter: each "rank"
is a forked process over its own buffer, the ranks' buffers shared host memory that every process writes,
as the GPUs' symmetric memory is. Its sums are checked against ``torch.sum`` over many calls in a row (so both
phases and the reset of every slot are exercised), with messages of different sizes, -0.0 inputs, and
a peer that never comes (the poll gives up and counts it)."""

import multiprocessing

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import interpreter_enabled
from tokenmill.kernels.push_all_reduce import BLOCK, push_all_reduce, sentinel_bits

CAPACITY = 2 * BLOCK + 64  # three programs for the largest message below
# The ranks here are forked processes over host memory, which only the interpreter's kernels read; on GPUs
# the kernel runs between real ranks in tests/test_tensor_parallel_gpu.py.
INTERPRETED_RANKS = pytest.mark.skipif(
    not interpreter_enabled(), reason="ranks over shared host memory need Triton's CPU interpreter"
)


class Ranks:
    """``world`` ranks' buffers, phase counters and time-out counters, as the GPU path sets them up, in
    shared memory, so that forked processes (one per rank, as on the GPUs) see them at the same addresses."""

    def __init__(self, world: int, dtype: torch.dtype) -> None:
        bits, sentinel = sentinel_bits(dtype)
        self.buffers = [
            torch.full((2, world, CAPACITY), sentinel, dtype=bits).share_memory_() for _ in range(world)
        ]
        self.pointers = torch.tensor([buffer.data_ptr() for buffer in self.buffers], dtype=torch.int64)
        self.phases = [torch.zeros(3, dtype=torch.int32).share_memory_() for _ in range(world)]
        self.timed_out = [torch.zeros(1, dtype=torch.int32).share_memory_() for _ in range(world)]
        self.world = world

    def call(self, rank: int, x: torch.Tensor, max_polls: int = 1 << 20) -> torch.Tensor:
        return push_all_reduce(
            x, self.pointers, self.phases[rank], self.timed_out[rank], CAPACITY, rank, max_polls=max_polls
        )

    def all_reduce_calls(self, calls: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Each rank in its own forked process makes every call in order (``calls[k][rank]``: its input to
        call k); returns each call's outputs, by rank."""
        outputs = [[torch.empty_like(x).share_memory_() for x in inputs] for inputs in calls]

        def run(rank: int) -> None:
            for inputs, results in zip(calls, outputs, strict=True):
                results[rank].copy_(self.call(rank, inputs[rank]))

        processes = [
            multiprocessing.get_context("fork").Process(target=run, args=(r,)) for r in range(self.world)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=300)
        assert [process.exitcode for process in processes] == [0] * self.world
        return outputs


@INTERPRETED_RANKS
@pytest.mark.parametrize(("world", "dtype"), [(2, torch.float32), (2, torch.bfloat16), (4, torch.float32)])
def test_sums_equal_torch_over_many_calls(world: int, dtype: torch.dtype) -> None:
    ranks = Ranks(world, dtype)
    generator = torch.Generator().manual_seed(world)
    sizes = [7, BLOCK, 2 * BLOCK + 64, 5, BLOCK + 1, 3 * 8, 2 * BLOCK + 64]
    calls = [[torch.randn(numel, generator=generator).to(dtype) for _ in range(world)] for numel in sizes]
    calls[1][0][:3] = -0.0  # the sentinel's bits: pushed as +0.0
    outputs = ranks.all_reduce_calls(calls)
    for call, (inputs, results) in enumerate(zip(calls, outputs, strict=True)):
        expected = torch.stack([x.float() for x in inputs]).sum(0).to(dtype)
        for rank, output in enumerate(results):
            assert torch.equal(output, results[0]), f"call {call}: ranks 0 and {rank} differ"
            # float32: exact; bfloat16: the interpreter rounds the float32 sum to bfloat16 by truncation
            ulp = 0.0 if dtype == torch.float32 else 2.0**-7
            torch.testing.assert_close(output, expected, rtol=ulp, atol=0, msg=f"call {call}, rank {rank}")
    _, sentinel = sentinel_bits(dtype)
    for buffer in ranks.buffers:  # every slot reset for the next calls
        assert bool((buffer == sentinel).all())
    assert sum(int(t.item()) for t in ranks.timed_out) == 0


@INTERPRETED_RANKS
def test_a_missing_peer_times_out_instead_of_hanging() -> None:
    ranks = Ranks(2, torch.float32)
    x = torch.ones(16)
    output = ranks.call(0, x, max_polls=8)
    assert int(ranks.timed_out[0].item()) == 1
    torch.testing.assert_close(output, x)  # only its own part arrived


def test_too_large_a_message_is_refused() -> None:
    ranks = Ranks(2, torch.float32)
    with pytest.raises(ValueError, match="capacity"):
        push_all_reduce(
            torch.ones(CAPACITY + 1), ranks.pointers, ranks.phases[0], ranks.timed_out[0], CAPACITY, 0
        )
