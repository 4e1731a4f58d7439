"""Exploration for issue 18 on an H100/H200: the W8A8 GEMM (``kernels/w8a8_gemm.py``) with its input
features split ``split_k`` ways, µs per call of Llama-3.1-8B's projections at decode batches of 16-256 rows
(the nano-vllm throughput run's), against the landed unsplit configs; weights cycled through >= 512 MB so
they come from memory; weight bytes / time; each variant checked against the float32 product of the same
quantized operands, and the split ones against the unsplit result (the same sums in another order).

    PYTHONPATH=src python scripts/experiments/w8a8_split_k_ab.py [float8|int8] [8b|1b] [ROWS]
"""

import sys

import torch
import triton
import triton.testing

import tokenmill.kernels.w8a8_gemm as gemm
from tokenmill.kernels.w8a8_gemm import W8A8GemmConfig, default_w8a8_gemm_config, w8a8_gemm

MODELS = {
    "8b": {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)},
    "1b": {"q/k/v": (3072, 2048), "o": (2048, 2048), "gate/up": (16384, 2048), "down": (2048, 8192)},
}
ROWS = "16,64,128,178,256"
SMS = 132


def variants(rows: int, n: int, k: int) -> dict[str, W8A8GemmConfig]:
    """The tiles chosen without splits first (the first one timed is the reference of the others), the
    default rule's, then splits of a few tiles."""
    limit, gemm.SPLIT_MAX_ROWS = gemm.SPLIT_MAX_ROWS, 0
    unsplit = default_w8a8_gemm_config(rows, n, k)
    gemm.SPLIT_MAX_ROWS = limit
    rule = default_w8a8_gemm_config(rows, n, k)
    found = {f"unsplit {tuple(unsplit[:5])}": unsplit, f"rule {tuple(rule)}": rule}
    for base in {unsplit, W8A8GemmConfig(64, 128, 128, 4, 4), W8A8GemmConfig(64, 64, 128, 4, 4)}:
        for split in (2, 3, 4, 6, 8):
            if k % (base.block_k * split) == 0 and k // split >= 512:
                found[f"{tuple(base[:5])} split {split}"] = base._replace(split_k=split)
    return found


def main(kind: str = "float8", model: str = "8b", rows: str = ROWS) -> None:
    dtype = torch.float8_e4m3fn if kind == "float8" else torch.int8
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, kind, flush=True)
    for name, (n, k) in MODELS[model].items():
        copies = max(1, (512 << 20) // (n * k))
        w8 = [(torch.randn(n, k, device="cuda") * 32).clamp(-127, 127).to(dtype) for _ in range(copies)]
        w_scale = torch.full((n,), 1 / 64, device="cuda")
        for m in map(int, rows.split(",")):
            x = torch.randn(m, k, device="cuda")
            x_scale = x.abs().amax(1, keepdim=True) / (448 if kind == "float8" else 127)
            x_q = (x / x_scale).round().to(dtype) if kind == "int8" else (x / x_scale).to(dtype)
            ref = (x_q.float() * x_scale) @ (w8[0].float() * w_scale[:, None]).t()
            unsplit = None
            for label, config in variants(m, n, k).items():
                if label.startswith("(") and "--rule-only" in sys.argv:
                    continue
                try:
                    out = w8a8_gemm(x_q, w8[0], x_scale, w_scale, None, torch.float32, config)
                    err = float((out - ref).norm() / ref.norm())
                    if config.split_k == 1:
                        unsplit = out
                    same = "" if unsplit is None else f" vs unsplit {float((out - unsplit).abs().max()):.1e}"

                    def call_all(config=config, w8=w8, x_q=x_q, x_scale=x_scale, w_scale=w_scale) -> None:
                        for w in w8:
                            w8a8_gemm(x_q, w, x_scale, w_scale, None, torch.bfloat16, config)

                    us = triton.testing.do_bench_cudagraph(call_all, rep=60) * 1e3 / copies
                except Exception as error:
                    print(f"{name:8} M={m:4} {label:34} FAILED {str(error)[:300]}", flush=True)
                    continue
                tiles = triton.cdiv(m, config.block_m) * (n // config.block_n) * config.split_k
                print(
                    f"{name:8} M={m:4} {label:34} {us:8.2f} us {n * k / us / 1e6:5.2f} TB/s "
                    f"programs {tiles:5d} ({tiles / SMS:4.1f}/SM) relerr {err:.1e}{same}",
                    flush=True,
                )


if __name__ == "__main__":
    main(*[arg for arg in sys.argv[1:] if arg != "--rule-only"])
