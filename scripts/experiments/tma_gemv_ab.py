"""Exploration for issue 18 on an H100/H200: the one-row GEMV with TMA-fed, pipelined weight tiles
(``tma_gemv_kernel.py``) against the landed kernels (``kernels/gemv.py``, its tensor-core route for the
widest 8-bit outputs), per call at Llama-3.1-8B's shapes with their prologues: µs under CUDA-graph replay
with programmatic launch, weights cycled through >= 256 MB (read from memory, not L2), weight bytes / time,
relative error against float64.

    PYTHONPATH=src python scripts/experiments/tma_gemv_ab.py [int8,float8_e4m3fn,bfloat16]
"""

import pathlib
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from persistent_gemv_ab import SHAPES, Inputs, landed, quantized, reference
from tma_gemv_kernel import tma_gemv
from triton.tools.tensor_descriptor import TensorDescriptor

CONFIGS = [
    (8, 256, 4, 6), (16, 128, 4, 6), (16, 256, 4, 4), (16, 256, 4, 6), (32, 128, 4, 6), (32, 256, 4, 4),
    (32, 256, 8, 4), (32, 256, 8, 6), (64, 128, 8, 4), (64, 256, 8, 3), (64, 256, 8, 4),
]  # fmt: skip
PEELED = [(16, 256, 4, 6), (32, 256, 8, 4)]


def main(dtypes: list[torch.dtype]) -> None:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for dtype in dtypes:
        configs = CONFIGS if dtype != torch.bfloat16 else [(16, 128, 4, 4), (16, 128, 4, 6), (32, 128, 8, 4)]
        for name, n, k, prologue in SHAPES:
            bytes_per_matrix = n * k * dtype.itemsize
            weights = [quantized(n, k, dtype) for _ in range(max(1, (256 << 20) // bytes_per_matrix))]
            inputs = Inputs(k, prologue)
            runs = {"landed": [lambda w, s, d=None: landed(inputs, w, s, prologue)] * len(weights)}
            for config in configs:
                for peel in (False, True) if config in PEELED else (False,):
                    descriptors = [TensorDescriptor.from_tensor(w, list(config[:2])) for w, _ in weights]
                    runs["tma-" + "-".join(map(str, config)) + ("-peel" if peel else "")] = [
                        lambda w, s, d=d, c=config, p=peel: tma_gemv(
                            inputs.x, w, s, c, prologue, inputs.residual, inputs.norm, 1e-5, True, d, p
                        )[0]
                        for d in descriptors
                    ]
            ref = reference(inputs, *weights[0], prologue)
            for vname, calls in runs.items():
                try:
                    err = float((calls[0](*weights[0]).double() - ref).norm() / ref.norm())

                    def call_all(calls=calls) -> None:
                        for call, (w, s) in zip(calls, weights):
                            call(w, s)

                    us = triton.testing.do_bench_cudagraph(call_all, rep=100) * 1e3 / len(weights)
                except Exception as error:
                    print(f"{name:8} {vname:22} failed: {str(error).splitlines()[0][:160]}", flush=True)
                    continue
                dname = str(dtype).split(".")[-1]
                print(
                    f"{dname:14} {name:8} {vname:22} {us:8.2f} us {bytes_per_matrix / us / 1e6:6.2f} TB/s "
                    f"relerr {err:.2e}",
                    flush=True,
                )


if __name__ == "__main__":
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["int8", "float8_e4m3fn", "bfloat16"]
    main([getattr(torch, name) for name in names])
