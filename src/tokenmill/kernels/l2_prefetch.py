"""Pulling the bytes the next kernel reads into the GPU's L2 cache while the current one leaves memory idle.

At small-batch decode the attention kernel is latency-bound: a few programs walk a short context while the
DRAM sits mostly idle, and the output projection after it then streams its whole weight. A kernel that
knows what comes next can let its programs issue bulk L2 prefetches of that weight (Hopper's
``cp.async.bulk.prefetch.L2``: no registers, no waiting), so the projection finds it in L2. The prefetch is
a hint: it changes no result, and bytes it misses are simply read from memory later.

:func:`prefetch_range` cuts ``nbytes`` into one slice per program and per lane (plain arithmetic, which
the interpreter runs and the tests check); :func:`issue_prefetch` emits the instruction (compiled Triton on
compute capability 9.0 or later only: the interpreter has no inline PTX).
"""

import triton
import triton.language as tl

PREFETCH_ALIGN = tl.constexpr(16)  # bytes: cp.async.bulk wants 16-byte aligned addresses and sizes


@triton.jit
def linear_program_id() -> tl.tensor:
    """This program's index in its grid, row-major over the three grid axes."""
    axis1 = tl.num_programs(1)
    axis2 = tl.num_programs(2)
    return (tl.program_id(0) * axis1 + tl.program_id(1)) * axis2 + tl.program_id(2)


@triton.jit
def prefetch_range(
    nbytes: tl.tensor, program: tl.tensor, programs: tl.tensor, threads: tl.constexpr, pieces: tl.constexpr
) -> tuple[tl.tensor, tl.tensor]:
    """(offsets, sizes) in bytes, one per thread, of this program's share of ``[0, nbytes)`` cut into
    ``pieces`` (<= ``threads``) consecutive slices; 16-byte aligned, sizes multiples of 16, zero for the
    threads past ``pieces`` and past the end (the last < 16 bytes are left out)."""
    nbytes = nbytes.to(tl.int64)
    per_program = tl.cdiv(tl.cdiv(nbytes, programs), PREFETCH_ALIGN * pieces) * PREFETCH_ALIGN * pieces
    per_piece = per_program // pieces
    lane = tl.arange(0, threads)
    offsets = program.to(tl.int64) * per_program + lane.to(tl.int64) * per_piece
    sizes = tl.minimum(tl.maximum(nbytes - offsets, 0), per_piece) // PREFETCH_ALIGN * PREFETCH_ALIGN
    return offsets, tl.where(lane < pieces, sizes, 0).to(tl.int32)


@triton.jit
def issue_prefetch(base_ptr: tl.tensor, offsets: tl.tensor, sizes: tl.tensor) -> None:
    """Bulk-prefetch ``sizes[i]`` bytes at ``base_ptr`` + ``offsets[i]`` into L2 (zero sizes skipped)."""
    addresses = base_ptr.to(tl.pointer_type(tl.int8)) + offsets
    tl.inline_asm_elementwise(
        "{ .reg .pred nonempty; setp.ne.u32 nonempty, $2, 0; "
        "@nonempty cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addresses, sizes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_my_share(
    base_ptr: tl.tensor, nbytes: tl.tensor, threads: tl.constexpr, pieces: tl.constexpr
) -> None:
    """This program's share of prefetching ``nbytes`` at ``base_ptr`` (the grid's programs together cover
    all of it), issued as ``pieces`` bulk prefetches; ``threads``: the program's, 32 per warp."""
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    offsets, sizes = prefetch_range(nbytes, linear_program_id(), programs, threads, pieces)
    issue_prefetch(base_ptr, offsets, sizes)
