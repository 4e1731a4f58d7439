"""Exploration for issue 18 on an H100/H200: the split-K tensor-core GEMV (``split_k_gemv_kernel.py``) for
the narrow 8-bit projections of Llama-3.1-8B (q/k/v, o, down), against the landed CUDA-core GEMV.

``kernels``: µs per call (CUDA-graph timing with programmatic launch, weights cycled through >= 256 MB),
weight bytes / time and the relative error against float64, each call made twice in a row first (the
per-tile counters must come back to zero), for block_n x slice_cols x stages.
``engine [SPEC]``: batch-1 decode of dummy llama-3.1-8b for int8 and fp8 (128-token prompt, 160 tokens,
median of 3, each in a fresh process), landed vs the narrow projections routed through the split-K
kernel; SPEC is a JSON ``{"norm": [block_n, block_k, warps, stages, slice_cols], "plain": [...],
"gated": [...]}`` (default below).

    PYTHONPATH=src python scripts/experiments/split_k_gemv_ab.py kernels|engine [SPEC]
"""

import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_SPEC = {"norm": [64, 256, 4, 4, 1024], "plain": [64, 256, 4, 4, 1024], "gated": [64, 256, 4, 4, 2048]}

KERNELS = r"""
import sys, torch, triton
sys.path.insert(0, HERE)
from persistent_gemv_ab import SHAPES, Inputs, landed, quantized, reference
from split_k_gemv_kernel import launch_split_k_gemv
def split(inputs, w, s, prologue, block, slice_cols):
    k = w.shape[1]
    out = torch.empty(1, w.shape[0], device="cuda", dtype=torch.bfloat16)
    new_residual = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
    launch_split_k_gemv(inputs.x, w, s, out, block, slice_cols, prologue, True, inputs.residual, inputs.norm,
                        new_residual, 1e-5)
    return out
for dtype in (torch.int8, torch.float8_e4m3fn):
    for name, n, k, prologue in SHAPES[:2] + SHAPES[3:4]:
        weights = [quantized(n, k, dtype) for _ in range(max(1, (256 << 20) // (n * k)))]
        inputs = Inputs(k, prologue)
        runs = {"landed": lambda w, s: landed(inputs, w, s, prologue)}
        for block_n in (32, 64):
            for slice_cols in (512, 1024, 2048):
                for stages in (3, 4):
                    runs[f"split-{block_n}-{slice_cols}-{stages}"] = (
                        lambda w, s, b=(block_n, 256, 4, stages), c=slice_cols: split(inputs, w, s, prologue, b, c))
        ref = reference(inputs, *weights[0], prologue)
        for vname, run in runs.items():
            errs = [float((run(*weights[0]).double() - ref).norm() / ref.norm()) for _ in range(2)]
            def call_all(run=run):
                for w, s in weights:
                    run(w, s)
            us = triton.testing.do_bench_cudagraph(call_all, rep=100) * 1e3 / len(weights)
            errs.append(float((run(*weights[0]).double() - ref).norm() / ref.norm()))
            d = str(dtype).split(".")[-1]
            print(f"{d:14} {name:8} {vname:16} {us:8.2f} us {n * k / us / 1e6:6.2f} TB/s relerr {max(errs):.2e}", flush=True)
"""

ENGINE = r"""
import sys, json
import torch
sys.path.insert(0, HERE)
from tokenmill.kernels import gemv
from split_k_gemv_kernel import launch_split_k_gemv
cfg = json.loads(sys.argv[1])
spec = cfg.get("spec")
KIND = {gemv.PLAIN: "plain", gemv.RMS_NORM: "norm", gemv.ADD_RMS_NORM: "norm", gemv.SILU_AND_MUL: "gated",
        gemv.GELU_TANH_AND_MUL: "gated"}
original_launch = gemv._launch
def launch(x, weight, bias, prologue, in_features, config, pdl, residual=None, norm_weight=None, eps=0.0,
           unit_offset=False, out_dtype=None, weight_scale=None):
    if (spec and config is None and bias is None and weight.element_size() == 1 and x.shape[0] == 1
            and weight.shape[0] < gemv.TENSOR_CORE_MIN_FEATURES and x.dtype == torch.bfloat16):
        *block, slice_cols = spec[KIND[prologue]]
        out = torch.empty(1, weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
        new_residual = torch.empty_like(x) if residual is not None else None
        launch_split_k_gemv(x, weight, weight_scale, out, tuple(block), slice_cols, prologue, pdl, residual,
                            norm_weight, new_residual, eps, unit_offset)
        return out, new_residual
    return original_launch(x, weight, bias, prologue, in_features, config, pdl, residual, norm_weight, eps,
                           unit_offset, out_dtype, weight_scale)
gemv._launch = launch
from tokenmill import LLM, SamplingParams
from decode_rate import decode_rate
llm = LLM(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16", quantization=cfg["quantization"],
          max_model_len=512)
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
first = llm.generate([{"prompt_token_ids": list(range(1000, 1128))}], params)[0].outputs[0].token_ids
rate, rates = decode_rate(llm)
print("RESULT", sys.argv[1], f"{rate:.1f} tok/s", [round(r, 1) for r in rates], "tokens", list(first), flush=True)
"""


def main(argv: list[str]) -> None:
    prefix = f"HERE = {str(HERE)!r}\n"
    if argv[:1] == ["kernels"]:
        subprocess.run([sys.executable, "-c", prefix + KERNELS], timeout=500)
        return
    spec = json.loads(argv[1]) if len(argv) > 1 else DEFAULT_SPEC
    for quantization in ("int8", "fp8"):
        for variant in ({"quantization": quantization}, {"quantization": quantization, "spec": spec}):
            r = subprocess.run(
                [sys.executable, "-c", prefix + ENGINE, json.dumps(variant)], capture_output=True, text=True,
                timeout=240,
            )  # fmt: skip
            lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
            print(lines[0] if lines else f"FAILED {variant}: {r.stderr[-1500:]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
