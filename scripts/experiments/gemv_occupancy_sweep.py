"""Exploration for issue 18 on an H100/H200, after an Nsight Compute profile of the int8 gate/up GEMV
(164 registers under Triton 3.6: three programs of 4 warps per SM, 0.56 instructions issued per scheduler
and cycle, 2.4 TB/s; bfloat16's GEMV of the same shape: 128 registers, four programs, 3.7 TB/s):

* ``cuda-maxnreg-R``: the landed CUDA-core GEMV (``kernels/gemv.py``) compiled with at most R registers
  (``maxnreg``; what does not fit spills to local memory), for more programs per SM;
* ``tc-N-K-S``: the tensor-core GEMV (``kernels/gemv_tensor_core.py``) at block_n N, block_k K, 4 warps,
  S stages, for every projection (the gated prologue included), where the default sends only gate/up
  and the LM head of e4m3 weights there.

µs per call at Llama-3.1-8B's shapes with their prologues (CUDA-graph timing with programmatic launch,
weights cycled through >= 256 MB), weight bytes / time, relative error against float64.

    PYTHONPATH=src python scripts/experiments/gemv_occupancy_sweep.py
"""

import pathlib
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from persistent_gemv_ab import SHAPES, Inputs, landed, quantized, reference

from tokenmill.kernels import gemv
from tokenmill.kernels.gemv_tensor_core import launch_tensor_core_gemv

TENSOR_CORE_BLOCKS = [(n, k, 4, s) for n in (16, 32, 64, 128) for k in (256, 512) for s in (3, 4)]


def tensor_core(
    inputs: Inputs, w: torch.Tensor, s: torch.Tensor, prologue: int, block: tuple
) -> torch.Tensor:
    k = w.shape[1]
    out = torch.empty(1, w.shape[0], device="cuda", dtype=torch.bfloat16)
    new_residual = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
    launch_tensor_core_gemv(
        inputs.x, w, s, None, out, block, prologue, True, inputs.residual, inputs.norm, new_residual, 1e-5
    )
    return out


def with_maxnreg(registers: int):
    """The landed kernel's launch with ``maxnreg`` added to its launch options."""
    original = gemv.launch_options

    def run(inputs: Inputs, w: torch.Tensor, s: torch.Tensor, prologue: int) -> torch.Tensor:
        gemv.launch_options = lambda pdl: {**original(pdl), "maxnreg": registers}
        try:
            return landed(inputs, w, s, prologue)
        finally:
            gemv.launch_options = original

    return run


def main() -> None:
    for dtype in (torch.int8, torch.float8_e4m3fn):
        for name, n, k, prologue in SHAPES:
            bytes_per_matrix = n * k
            weights = [quantized(n, k, dtype) for _ in range(max(1, (256 << 20) // bytes_per_matrix))]
            inputs = Inputs(k, prologue)
            runs = {"landed": lambda w, s: landed(inputs, w, s, prologue)}
            if dtype == torch.int8:
                for registers in (128, 96):
                    runs[f"cuda-maxnreg-{registers}"] = lambda w, s, r=with_maxnreg(registers): r(
                        inputs, w, s, prologue
                    )
            for block in TENSOR_CORE_BLOCKS:
                runs[f"tc-{block[0]}-{block[1]}-{block[3]}"] = lambda w, s, b=block: tensor_core(
                    inputs, w, s, prologue, b
                )
            ref = reference(inputs, *weights[0], prologue)
            for vname, run in runs.items():
                try:
                    err = float((run(*weights[0]).double() - ref).norm() / ref.norm())

                    def call_all(run=run) -> None:
                        for w, s in weights:
                            run(w, s)

                    us = triton.testing.do_bench_cudagraph(call_all, rep=100) * 1e3 / len(weights)
                except Exception as error:  # a config that does not compile (shared memory) is skipped
                    print(f"{name:8} {vname:16} failed: {str(error).splitlines()[0][:120]}", flush=True)
                    continue
                dname = str(dtype).split(".")[-1]
                rate = bytes_per_matrix / us / 1e6
                print(
                    f"{dname:14} {name:8} {vname:16} {us:8.2f} us {rate:6.2f} TB/s relerr {err:.2e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
