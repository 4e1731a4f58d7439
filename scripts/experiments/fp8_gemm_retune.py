"""Exploration for issue 18 on an H100/H200 (run with OUT set to a folder): sweep 12 fp8 GEMM tiles at
Llama-3.1-8B's shapes and 64-256 rows, keep the best per (shape, row bucket), then run the nano-vllm throughput
with that table patched in and with the landed rule (reports/gpu/quantized-llama-3.1-8b/fp8-gemm/)."""
import json
import os
import subprocess
import sys

import torch
import triton.testing

from tokenmill.kernels.w8a8_gemm import W8A8GemmConfig as Fp8GemmConfig
from tokenmill.kernels.w8a8_gemm import default_w8a8_gemm_config as default_fp8_gemm_config
from tokenmill.kernels.w8a8_gemm import w8a8_gemm as fp8_gemm

OUT = os.environ["OUT"]
SHAPES = {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}
BUCKETS = (64, 128, 178, 256)
CONFIGS = [(64, 128, 128, 4, 6), (64, 128, 128, 4, 4), (128, 256, 128, 8, 3), (128, 128, 128, 8, 4),
           (128, 128, 128, 8, 3), (256, 128, 128, 8, 3), (128, 256, 128, 8, 4), (64, 256, 128, 4, 4),
           (128, 128, 256, 8, 3), (64, 128, 256, 4, 4), (256, 128, 64, 8, 4), (64, 64, 128, 4, 6)]
table = {}
for name, (n, k) in SHAPES.items():
    copies = max(1, (512 << 20) // (n * k))
    w8 = [torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn) for _ in range(copies)]
    ws = torch.ones(n, device="cuda")
    for m in BUCKETS:
        x_q = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        xs = torch.ones(m, 1, device="cuda")
        times = {}
        for c in CONFIGS + [tuple(default_fp8_gemm_config(m, n))]:
            cfg = Fp8GemmConfig(*c)
            try:
                def call_all(cfg=cfg):
                    for w in w8:
                        fp8_gemm(x_q, w, xs, ws, None, torch.bfloat16, cfg)
                times[c] = triton.testing.do_bench_cudagraph(call_all, rep=30) * 1e3 / copies
            except Exception as e:
                print(name, m, c, "FAILED", str(e)[:120], flush=True)
        best = min(times, key=times.get)
        landed = tuple(default_fp8_gemm_config(m, n, k))
        print(f"{name:8} M={m:4} landed {landed} {times[landed]:7.2f} us  best {best} {times[best]:7.2f} us", flush=True)
        table[f"{n},{k},{m}"] = list(best)
json.dump(table, open(f"{OUT}/table.json", "w"))
PATCH = r'''
import json, sys
import tokenmill.kernels.w8a8_gemm as g
table = json.load(open(sys.argv[1]))
landed = g.default_w8a8_gemm_config
def config(rows, out_features, in_features=None):
    return landed(rows, out_features, in_features)
def fits_patch():
    original_fits = g.w8a8_gemm_fits
    def pick(rows, weight, cfg=None):
        return cfg or lookup(rows, *weight.shape)
    def lookup(rows, n, k):
        bucket = next((b for b in (16, 64, 128, 178, 256) if rows <= (b if b != 178 else 192)), 256)
        entry = table.get(f"{n},{k},{bucket}")
        return g.W8A8GemmConfig(*entry) if entry else landed(rows, n, k)
    original_gemm = g.w8a8_gemm
    def gemm(x_q, weight, x_scale, weight_scale, bias, out_dtype, cfg=None):
        return original_gemm(x_q, weight, x_scale, weight_scale, bias, out_dtype, pick(x_q.shape[0], weight, cfg))
    def fits(rows, weight, cfg=None):
        return original_fits(rows, weight, pick(rows, weight, cfg) if 1 < rows <= 256 else cfg)
    g.w8a8_gemm, g.w8a8_gemm_fits = gemm, fits
    import tokenmill.kernels.scaled_matmul as s
    s.w8a8_gemm, s.w8a8_gemm_fits = gemm, fits
fits_patch()
from tokenmill.cli import main
sys.exit(main(sys.argv[2:]))
'''
ARGS = ["bench", "throughput", "--model", "llama-3.1-8b", "--load-format", "dummy", "--dtype", "bfloat16",
        "--skip-hf", "--no-progress", "--dataset", "nano-vllm", "--quantization", "fp8"]
for label, cmd in (("tuned", [sys.executable, "-c", PATCH, f"{OUT}/table.json"]), ("landed", [sys.executable, "-m", "tokenmill.cli"])):
    r = subprocess.run(cmd + ARGS + ["--report-dir", f"{OUT}/throughput-fp8-{label}"], capture_output=True, text=True, timeout=170)
    lines = [l for l in (r.stdout + r.stderr).splitlines() if "tokenmill (paged" in l or "correctness" in l or "Error" in l]
    print(label, lines[-3:], flush=True)
