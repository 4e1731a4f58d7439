"""Exploration for issue 18 on an H100/H200: µs per call of Llama-3.1-8B's projections at decode batches
of 16-512 rows: bf16 ``F.linear``, ``torch._scaled_mm`` rowwise (``fp8_linear``'s GEMM, activations
already quantized), and tokenmill's e4m3 GEMM (``kernels/w8a8_gemm.py``) over a few tile configs; weights
cycled through >= 512 MB so that they come from memory; weight bytes / time; relative error against the
float32 product of the same quantized operands.

    PYTHONPATH=src python scripts/experiments/fp8_gemm_ab.py
"""

import torch
import triton.testing

from tokenmill.kernels.w8a8_gemm import W8A8GemmConfig, w8a8_gemm

SHAPES = {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}
ROWS = (16, 64, 128, 178, 256, 512)
CONFIGS = ((64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 128, 128, 8, 4),
           (64, 64, 256, 4, 3), (128, 128, 64, 4, 5), (64, 128, 128, 4, 6), (128, 256, 128, 8, 3))  # fmt: skip


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for name, (n, k) in SHAPES.items():
        copies = max(1, (512 << 20) // (n * k))
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
        w8 = [(w * 64).to(torch.float8_e4m3fn) for w in w16]
        w_scale = torch.full((1, n), 1 / 64, device="cuda")
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_scale = x.float().abs().amax(1, keepdim=True) / 448
            x_q = (x.float() / x_scale).to(torch.float8_e4m3fn)
            ref = (x_q.float() * x_scale) @ (w8[0].float() * w_scale.view(-1, 1)).t()
            runs = {
                "bf16": lambda w, i: torch.nn.functional.linear(x, w16[i]),
                "scaled_mm": lambda w, i: torch._scaled_mm(x_q, w.t(), scale_a=x_scale, scale_b=w_scale,
                                                           out_dtype=torch.bfloat16),  # fmt: skip
            }
            for config in CONFIGS:
                runs[f"triton{config}"] = lambda w, i, c=W8A8GemmConfig(*config): w8a8_gemm(
                    x_q, w, x_scale, w_scale, None, torch.bfloat16, c
                )
            for variant, run in runs.items():
                try:
                    out = run(w8[0], 0)
                    err = float((out.float() - ref).norm() / ref.norm()) if variant != "bf16" else 0.0

                    def call_all(run=run) -> None:
                        for i, w in enumerate(w8):
                            run(w, i)

                    us = triton.testing.do_bench_cudagraph(call_all, rep=60) * 1e3 / copies
                except Exception as error:
                    print(f"{name:8} M={m:4} {variant:34} FAILED {str(error)[:200]}", flush=True)
                    continue
                bytes_ = n * k * (2 if variant == "bf16" else 1)
                print(f"{name:8} M={m:4} {variant:34} {us:8.2f} us {bytes_ / us / 1e6:5.2f} TB/s "
                      f"relerr {err:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
