"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start while the one before it in the
stream is still finishing, and waits for it only where it reads what that kernel wrote.

At batch-1 decode every kernel is short, so the gap between one kernel's last program and the next one's
first (launch, then the first loads from memory) is a large share of the step. With ``pdl`` a kernel is
launched with the PDL attribute; it first loads what no earlier kernel of the step writes (weights, the
step's inputs), then calls :func:`wait_for_previous_kernel` before anything else, and from there lets the
next kernel launch. The wait covers the whole chain: the kernel before it waited for its own predecessor
before finishing. A kernel launched this way must reach the wait in every program that reads or writes
activations, or the ordering is lost.
"""

import triton
import triton.language as tl


def launch_options(pdl: bool) -> dict[str, bool]:
    """Launch keywords for ``kernel[grid](...)``: nothing extra without ``pdl`` (the interpreter, and
    GPUs before Hopper, know no such launch)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_previous_kernel(pdl: tl.constexpr) -> None:
    """With ``pdl``: block until the previous kernel has finished and its writes are visible, then allow
    the next kernel to launch (its programs take free SM slots and load their own constants)."""
    if pdl:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(base_ptr: tl.tensor, nbytes: tl.tensor, pieces: tl.constexpr) -> None:
    """Bulk-prefetch ``nbytes`` at ``base_ptr`` into L2 as ``pieces`` consecutive slices, one per thread of
    the first ``pieces`` (Hopper's ``cp.async.bulk.prefetch.L2``: no registers, no waiting; 16-byte
    aligned slices, the last < 16 bytes left out). A hint for what this program reads after its wait;
    compiled launches only (the interpreter has no inline PTX)."""
    per_piece = tl.cdiv(nbytes, 16 * pieces) * 16
    lane = tl.arange(0, pieces).to(tl.int64)
    offsets = lane * per_piece
    sizes = (tl.minimum(tl.maximum(nbytes - offsets, 0), per_piece) // 16 * 16).to(tl.int32)
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
