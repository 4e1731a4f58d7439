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


def register_limit(max_registers: int | None, on_cuda: bool) -> dict[str, int]:
    """Launch keywords capping a compiled kernel's registers per thread (``maxnreg``); nothing without a
    cap or off CUDA (the interpreter knows no registers)."""
    return {"maxnreg": max_registers} if max_registers and on_cuda else {}


@triton.jit
def wait_for_previous_kernel(pdl: tl.constexpr) -> None:
    """With ``pdl``: block until the previous kernel has finished and its writes are visible, then allow
    the next kernel to launch (its programs take free SM slots and load their own constants)."""
    if pdl:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
