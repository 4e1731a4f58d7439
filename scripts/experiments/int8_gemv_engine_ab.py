"""Exploration for issue 18: the int8 one-row GEMV's launch config, and a variant that reduces its
products every step (a [block_n] accumulator instead of a [block_n, block_k] tile), in the engine itself:
batch-1 decode of dummy llama-3.1-8b with int8 weights, each variant in a fresh process (the kernel's
config function, or the kernel compiled from a patched copy of ``kernels/gemv.py``, swapped in before the
engine is built), with a relative-error check of the variant on a gate/up-sized GEMV against float64.

    PYTHONPATH=src python scripts/experiments/int8_gemv_engine_ab.py   (MODEL=... for another preset)
"""

import json
import subprocess
import sys

CHILD = r"""
import sys, time, statistics, json
import torch
import tokenmill.kernels.gemv as gemv
cfg = json.loads(sys.argv[1])
label = sys.argv[1]
if cfg.pop("sum_per_step", False):  # accumulate [block_n] sums, one reduction per step, not a tile
    import importlib.util, pathlib
    src = pathlib.Path(gemv.__file__).read_text()
    edits = (
        ("products = tl.zeros([block_n, block_k], tl.float32)", "products = tl.zeros([block_n], tl.float32)"),
        ("products += as_float32(weight) * x[None, :]",
         "products += tl.sum(as_float32(weight) * x[None, :], axis=1)"),
        ("out = tl.sum(products, axis=1)", "out = products"),
    )
    for a, b in edits:
        assert a in src; src = src.replace(a, b)
    pathlib.Path("/tmp/gemv_sum.py").write_text(src)
    spec = importlib.util.spec_from_file_location("gemv_sum", "/tmp/gemv_sum.py")
    mod = importlib.util.module_from_spec(spec); sys.modules["gemv_sum"] = mod; spec.loader.exec_module(mod)
    gemv._gemv_kernel = mod._gemv_kernel
if cfg:
    orig = gemv._one_byte_config
    def patched(out_features, in_features):
        key = "down" if in_features > 8192 else ("gate_up" if out_features > 16384 else "other")
        c = cfg.get(key) or cfg.get("all")
        return gemv.GemvConfig(*c) if c else orig(out_features, in_features)
    gemv._one_byte_config = patched
from tokenmill import LLM, SamplingParams
import os
llm = LLM(model=os.environ.get("MODEL", "llama-3.1-8b"), load_format="dummy", dtype="bfloat16",
          quantization="int8", max_model_len=512)
ids = list(range(1000, 1128))
p = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
llm.generate([{"prompt_token_ids": ids}], p)
# decode rate: time a 1-token and 160-token request
def run(n):
    torch.cuda.is_available() and torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    torch.cuda.is_available() and torch.cuda.synchronize(); return time.perf_counter() - t
vals = []
for _ in range(3):
    a = run(1); b = run(161)
    vals.append(160 / (b - a))
err = -1.0
if torch.cuda.is_available():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(-127, 128, (28672, 4096), device="cuda", dtype=torch.int8)
    sc = torch.rand(28672, device="cuda") / 100
    got = gemv.gemv(x, w, weight_scale=sc).float()
    ref = x.double() @ (w.double() * sc.double()[:, None]).t()
    err = float((got.double() - ref).norm() / ref.norm())
print("RESULT", label, f"{statistics.median(vals):.1f}", f"relerr {err:.2e}", flush=True)
"""

configs = [
    {},
    {"sum_per_step": True},
    {"sum_per_step": True, "all": [8, 2048, 8, 2]},
    {"sum_per_step": True, "all": [16, 1024, 4, 2]},
    {"sum_per_step": True, "all": [8, 1024, 4, 3]},
    {"sum_per_step": True, "all": [8, 512, 4, 3]},
    {},
]
for cfg in configs:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, timeout=200
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
    print(lines[0] if lines else f"FAILED {cfg}: {r.stderr[-800:]}", flush=True)
