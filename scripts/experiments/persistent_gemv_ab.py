"""Exploration for issue 18 on an H100/H200: the 8-bit one-row GEMV with several tiles per program
(``persistent_gemv_kernel.py``) against the landed one-tile-per-program kernel, and a profile of both
with Nsight Compute's stall reasons.

``kernels``: µs per call at Llama-3.1-8B's shapes with their prologues (CUDA-graph timing, weights cycled
through >= 256 MB), weight bytes / time, relative error against float64, and the landed bf16 GEMV of
the same shape for the bytes-per-second it reaches.
``profile``: run the landed int8 and bf16 gate/up GEMVs a few times (for ``ncu -k regex:gemv``).

    PYTHONPATH=src python scripts/experiments/persistent_gemv_ab.py kernels|profile
"""

import pathlib
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from persistent_gemv_kernel import launch_flat_gemv

from tokenmill.kernels import gemv

SHAPES = [
    ("q/k/v", 6144, 4096, gemv.ADD_RMS_NORM),
    ("o", 4096, 4096, gemv.PLAIN),
    ("gate/up", 28672, 4096, gemv.ADD_RMS_NORM),
    ("down", 4096, 14336, gemv.SILU_AND_MUL),
    ("LM head", 128256, 4096, gemv.PLAIN),
]
SMS = 132


def quantized(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device="cuda")
    if dtype == torch.bfloat16:
        return w.to(dtype), torch.ones(n, device="cuda")
    scale = w.abs().amax(dim=1) / (127.0 if dtype == torch.int8 else 448.0)
    q = w / scale[:, None]
    return (q.round().to(dtype) if dtype == torch.int8 else q.to(dtype)), scale


class Inputs:
    def __init__(self, k: int, prologue: int) -> None:
        width = 2 * k if prologue == gemv.SILU_AND_MUL else k
        self.x = torch.randn(1, width, device="cuda", dtype=torch.bfloat16)
        self.residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        self.norm = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5


def landed(inputs: Inputs, w: torch.Tensor, s: torch.Tensor, prologue: int) -> torch.Tensor:
    scale = None if w.dtype == torch.bfloat16 else s
    if prologue == gemv.ADD_RMS_NORM:
        return gemv.rms_norm_gemv(
            inputs.x, w, inputs.norm, 1e-5, inputs.residual, weight_scale=scale, pdl=True
        )[0]
    if prologue == gemv.SILU_AND_MUL:
        return gemv.gated_gemv(inputs.x, w, "silu", weight_scale=scale, pdl=True)
    return gemv.gemv(inputs.x, w, weight_scale=scale, pdl=True)


def flat(inputs: Inputs, w: torch.Tensor, s: torch.Tensor, prologue: int, variant: tuple) -> torch.Tensor:
    block, programs, prefetch = variant
    k = w.shape[1]
    out = torch.empty(1, w.shape[0], device="cuda", dtype=torch.bfloat16)
    new_residual = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
    launch_flat_gemv(
        inputs.x, w, s, out, block, programs, prefetch, prologue, k, True, inputs.residual, inputs.norm,
        new_residual, 1e-5,
    )  # fmt: skip
    return out


def reference(inputs: Inputs, w: torch.Tensor, s: torch.Tensor, prologue: int) -> torch.Tensor:
    wd = w.double() * s.double()[:, None]
    if prologue == gemv.ADD_RMS_NORM:
        h = inputs.x.double() + inputs.residual.double()
        h = h / torch.sqrt((h * h).mean() + 1e-5) * inputs.norm.double()
    elif prologue == gemv.SILU_AND_MUL:
        g, u = inputs.x.double().chunk(2, dim=-1)
        h = torch.nn.functional.silu(g) * u
    else:
        h = inputs.x.double()
    return h @ wd.t()


def variants() -> dict[str, tuple]:
    out = {}
    for programs_per_sm in (2, 3, 4, 6):
        for prefetch in (True, False):
            name = f"p{programs_per_sm}{'' if prefetch else '-nopf'}"
            out[name] = ((8, 1024, 4, 2), SMS * programs_per_sm, prefetch)
    out["tiles"] = ((8, 1024, 4, 2), 1 << 30, True)  # one tile per program: the control
    out["p4-4x1024"] = ((4, 1024, 4, 2), SMS * 4, True)
    out["p2-8x1024-8w"] = ((8, 1024, 8, 2), SMS * 2, True)
    out["p3-nopf-s3"] = ((8, 1024, 4, 3), SMS * 3, False)
    return out


def time_kernels() -> None:
    for dtype in (torch.int8, torch.float8_e4m3fn, torch.bfloat16):
        for name, n, k, prologue in SHAPES:
            bytes_per_matrix = n * k * dtype.itemsize
            weights = [quantized(n, k, dtype) for _ in range(max(1, (256 << 20) // bytes_per_matrix))]
            inputs = Inputs(k, prologue)
            runs = {"landed": lambda w, s: landed(inputs, w, s, prologue)}
            if dtype != torch.bfloat16:
                for vname, variant in variants().items():
                    runs[vname] = lambda w, s, v=variant: flat(inputs, w, s, prologue, v)
            ref = reference(inputs, *weights[0], prologue)
            for vname, run in runs.items():
                err = float((run(*weights[0]).double() - ref).norm() / ref.norm())

                def call_all(run=run) -> None:
                    for w, s in weights:
                        run(w, s)

                us = triton.testing.do_bench_cudagraph(call_all, rep=200) * 1e3 / len(weights)
                dname = str(dtype).split(".")[-1]
                rate = bytes_per_matrix / us / 1e6
                print(
                    f"{dname:14} {name:8} {vname:14} {us:8.2f} us {rate:6.2f} TB/s relerr {err:.2e}",
                    flush=True,
                )


def profile() -> None:
    for dtype in (torch.int8, torch.bfloat16):
        _, n, k, prologue = SHAPES[2]
        w, s = quantized(n, k, dtype)
        inputs = Inputs(k, prologue)
        for _ in range(3):
            landed(inputs, w, s, prologue)
        if dtype == torch.int8:
            for _ in range(3):
                flat(inputs, w, s, prologue, variants()["p3"])
    torch.cuda.synchronize()


if __name__ == "__main__":
    time_kernels() if sys.argv[1:] == ["kernels"] else profile()
