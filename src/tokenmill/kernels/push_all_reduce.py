"""A one-shot all-reduce of small messages between the GPUs of one node with no barrier: each rank pushes
its input into every rank's buffer, then sums what has arrived in its own.

Every rank owns a buffer that all ranks can write (symmetric memory, see
:mod:`tokenmill.symmetric_all_reduce`), laid out as ``[2 phases, world, capacity]`` elements. A slot that
holds no data holds a sentinel, the bit pattern of -0.0, which a pushed value never has (a -0.0 input is
pushed as +0.0, the same number). So each element announces its own arrival (Lamport's scheme, as
TensorRT-LLM's low-latency all-reduce uses): a rank polls its own buffer until no sentinel is left in
the rows of the ranks it sums, with no barrier before or after. Once summed, it resets those slots to
the sentinel for the call after next.

Two phases suffice: a rank can push call k+2 into phase k % 2 of a peer only after it has summed call
k+1, which needed that peer's push of k+1, which the peer made after its kernel of call k had reset the
slots (kernels of a stream run in order; with programmatic launch, each waits for the one before it
before touching memory). The phase lives on the device (one counter per program, flipped by the program
at its end), so a call inside a CUDA graph takes the right phase at every replay. Every rank must make
the same sequence of calls, as tensor-parallel ranks do.

Each program sums ``BLOCK`` elements of every rank in float32, in rank order, so every rank gets the
same bits. A program that polls for ``max_polls`` rounds without all its elements (a dead peer) gives
up and leaves its count in ``timed_out``, so no GPU spins forever.
"""

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launch import launch_options, wait_for_previous_kernel

BLOCK = 1024  # elements per program: a 4096-wide row takes 4 programs (4 SMs)
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_SENTINEL = {torch.int16: -(1 << 15), torch.int32: -(1 << 31)}  # the bits of -0.0
MAX_POLLS = 1 << 26  # a few seconds of polling


def sentinel_bits(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """The integer type of ``dtype``'s bits and the sentinel (-0.0) in it."""
    if dtype not in _BITS:
        raise ValueError(f"the push all-reduce sums bfloat16, float16 or float32, not {dtype}")
    bits = _BITS[dtype]
    return bits, _SENTINEL[bits]


@triton.jit
def _push_all_reduce_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    buffer_ptrs: tl.tensor,  # int64 [world]: each rank's buffer, as an address this GPU can write
    phase_ptr: tl.tensor,  # int32 [programs]: the phase of each program's next call
    timed_out_ptr: tl.tensor,  # int32 [1]: polls that gave up
    n: int,
    capacity: int,
    rank: int,
    max_polls: int,
    world: tl.constexpr,
    block: tl.constexpr,
    sentinel: tl.constexpr,
    pdl: tl.constexpr,
) -> None:
    program = tl.program_id(0)
    phase = tl.load(phase_ptr + program)  # written by this program's previous call, kernels ago
    bits_type = tl.int16 if sentinel == -32768 else tl.int32
    own = tl.load(buffer_ptrs + rank).to(tl.pointer_type(bits_type))
    offsets = program * block + tl.arange(0, block)
    mask = offsets < n
    wait_for_previous_kernel(pdl)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    bits = x.to(bits_type, bitcast=True)
    bits = tl.where(bits == sentinel, tl.zeros_like(bits), bits)  # -0.0 -> +0.0
    for peer in tl.static_range(world):  # into slot [phase, rank] of every rank, this one too
        base = tl.load(buffer_ptrs + peer).to(tl.pointer_type(bits_type))
        tl.store(base + (phase * world + rank) * capacity + offsets, bits, mask=mask)
    sources = tl.arange(0, world)
    slots = own + (phase * world + sources[:, None]) * capacity + offsets[None, :]
    ready = mask[None, :] & (sources[:, None] < world)
    arrived = tl.load(slots, mask=ready, other=0, volatile=True)
    missing = tl.sum(tl.sum((arrived == sentinel).to(tl.int32), axis=1), axis=0)
    polls = missing * 0
    while (missing > 0) & (polls < max_polls):
        arrived = tl.load(slots, mask=ready, other=0, volatile=True)
        missing = tl.sum(tl.sum((arrived == sentinel).to(tl.int32), axis=1), axis=0)
        polls += 1
    if missing > 0:
        tl.atomic_add(timed_out_ptr, 1)
    total = tl.sum(arrived.to(x.dtype, bitcast=True).to(tl.float32), axis=0)  # in rank order
    tl.store(out_ptr + offsets, total.to(x.dtype), mask=mask)
    tl.store(slots, tl.full(arrived.shape, sentinel, bits_type), mask=ready)
    tl.store(phase_ptr + program, 1 - phase)


def push_all_reduce(
    x: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    phases: torch.Tensor,
    timed_out: torch.Tensor,
    capacity: int,
    rank: int,
    pdl: bool = False,
    max_polls: int = MAX_POLLS,
) -> torch.Tensor:
    """The sum of ``x`` (contiguous, at most ``capacity`` elements) over the ranks whose buffers
    ``buffer_ptrs`` lists, as a new tensor; ``phases`` holds one int32 per program of the largest call."""
    world = buffer_ptrs.numel()
    n = x.numel()
    programs = triton.cdiv(n, BLOCK)
    if n > capacity or programs > phases.numel():
        raise ValueError(f"{n} elements exceed the push all-reduce's capacity of {capacity}")
    if world & (world - 1):
        raise ValueError(f"the push all-reduce needs a power-of-2 number of ranks, not {world}")
    out = torch.empty_like(x)
    _, sentinel = sentinel_bits(x.dtype)
    _push_all_reduce_kernel[(programs,)](
        x,
        out,
        buffer_ptrs,
        phases,
        timed_out,
        n,
        capacity,
        rank,
        max_polls,
        world=world,
        block=BLOCK,
        sentinel=sentinel,
        pdl=pdl,
        num_warps=4,
        **launch_options(pdl),
    )
    return out
