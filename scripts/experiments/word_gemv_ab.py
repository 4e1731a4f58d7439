"""Exploration for issue 18, two variants of the 8-bit CUDA-core GEMV against the landed byte-wise one
(``g1``), H100/H200:

* ``words``: the weights read four to a 32-bit word and converted by one xor and four byte permutes
  (``word_gemv_kernel.py`` beside this script), a quarter of the integer work per weight;
* ``g16``: products summed over groups of 16 columns inside each thread before they enter the
  accumulator (``[block_n, block_k / 16]`` instead of ``[block_n, block_k]``: 76-80 registers instead of
  126), so that larger weight tiles fit (``g16-8x2048``).

1. Kernels alone at Llama-3.1-8B's shapes with their prologues: µs per call (CUDA-graph timing, weights
   cycled through >= 256 MB so that none stays in L2), weight bytes / time, and the relative error
   against a float64 reference.
2. Batch-1 decode of dummy llama-3.1-8b in the engine, each variant in a fresh process (128-token prompt,
   160 tokens, median of 3).

    PYTHONPATH=src python scripts/experiments/word_gemv_ab.py [kernels] [engine] [VARIANT ...]
"""

import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
# Applied to kernels/gemv.py's source in the child process (``gemv.GROUP`` then picks the group size).
GROUP_EDITS = (
    (
        "    block_k: tl.constexpr,\n    pdl: tl.constexpr,\n) -> None:",
        "    block_k: tl.constexpr,\n    group: tl.constexpr,\n    pdl: tl.constexpr,\n) -> None:",
    ),
    (
        "products = tl.zeros([block_n, block_k], tl.float32)",
        "products = tl.zeros([block_n, block_k // group], tl.float32)",
    ),
    (
        "products += as_float32(weight) * x[None, :]",
        "products += tl.sum(tl.reshape(as_float32(weight) * x[None, :], [block_n, block_k // group, group]), axis=2)",
    ),
    (
        "        block_k=config.block_k,\n        pdl=pdl,",
        "        block_k=config.block_k,\n        group=min(GROUP, config.block_k) if weight.element_size() == 1 else 1,\n        pdl=pdl,",
    ),
)
WORD_EDITS = (
    (
        "    _gemv_kernel[(",
        "    if WORDS and weight_scale is not None and reads_words(weight):\n"
        "        launch_word_gemv(x, weight, weight_scale, bias, out, config[:4], prologue, in_features, pdl, residual, norm_weight, new_residual, eps, unit_offset)\n"
        "        return out, new_residual\n    _gemv_kernel[(",
    ),
)
PATCH = f"""
import pathlib, sys, importlib.util
import tokenmill.kernels.gemv as _original
sys.path.insert(0, {str(HERE)!r})
from word_gemv_kernel import launch_word_gemv, reads_words
_source = pathlib.Path(_original.__file__).read_text()
for _old, _new in {GROUP_EDITS + WORD_EDITS!r}:
    assert _old in _source, _old
    _source = _source.replace(_old, _new)
_source += "\\nGROUP = 1\\nWORDS = False\\nfrom word_gemv_kernel import launch_word_gemv, reads_words\\n"
pathlib.Path("/tmp/gemv_variants.py").write_text(_source)
_spec = importlib.util.spec_from_file_location("tokenmill.kernels.gemv", "/tmp/gemv_variants.py")
gemv = importlib.util.module_from_spec(_spec); sys.modules["tokenmill.kernels.gemv"] = gemv
_spec.loader.exec_module(gemv)
"""

KERNELS = r"""
import torch, triton
SHAPES = [("q/k/v", 6144, 4096, "norm"), ("o", 4096, 4096, "plain"), ("gate/up", 28672, 4096, "norm"),
          ("down", 4096, 14336, "gated"), ("LM head", 128256, 4096, "plain")]
dev = "cuda"
def quantized(n, k, dtype):
    w = torch.randn(n, k, device=dev)
    scale = w.abs().amax(dim=1) / (127.0 if dtype == torch.int8 else 448.0)
    q = (w / scale[:, None])
    q = q.round().to(dtype) if dtype == torch.int8 else q.to(dtype)
    return q, scale
cfg = None
def call(kind, x, w, s, norm_w, res):
    if kind == "norm":
        return gemv.rms_norm_gemv(x, w, norm_w, 1e-5, res, weight_scale=s, pdl=True, config=cfg)[0]
    if kind == "gated":
        return gemv.gated_gemv(x, w, "silu", weight_scale=s, pdl=True, config=cfg)
    return gemv.gemv(x, w, weight_scale=s, pdl=True, config=cfg)
def reference(kind, x, w, s, norm_w, res):
    wd = w.double() * s.double()[:, None]
    if kind == "norm":
        h = x.double() + res.double()
        h = h / torch.sqrt((h * h).mean() + 1e-5) * norm_w.double()
    elif kind == "gated":
        g, u = x.double().chunk(2, dim=-1)
        h = torch.nn.functional.silu(g) * u
    else:
        h = x.double()
    return h @ wd.t()
rows = []
for dtype in (torch.int8, torch.float8_e4m3fn):
    for name, n, k, kind in SHAPES:
        copies = max(1, (256 << 20) // (n * k))
        ws = [quantized(n, k, dtype) for _ in range(copies)]
        x = torch.randn(1, 2 * k if kind == "gated" else k, device=dev, dtype=torch.bfloat16)
        res = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        norm_w = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
        for variant in ("g1", "words", "g16", "g16-8x2048"):
            gemv.WORDS = variant == "words"
            gemv.GROUP = 16 if variant.startswith("g16") else 1
            cfg = gemv.GemvConfig(8, 2048, 4, 2) if variant == "g16-8x2048" else None
            out = call(kind, x, ws[0][0], ws[0][1], norm_w, res).double()
            ref = reference(kind, x, ws[0][0], ws[0][1], norm_w, res)
            err = float((out - ref).norm() / ref.norm())
            def run():
                for w, s in ws:
                    call(kind, x, w, s, norm_w, res)
            us = triton.testing.do_bench_cudagraph(run, rep=200) * 1e3 / copies
            rows.append((str(dtype).split(".")[-1], name, variant, us, n * k / us / 1e6, err))
            print(f"{rows[-1][0]:14} {name:8} {rows[-1][2]:10} {us:8.2f} us {rows[-1][4]:7.2f} TB/s relerr {err:.2e}", flush=True)
print("KERNELS", json.dumps(rows))
"""

ENGINE = r"""
import sys, json, os
cfg = json.loads(sys.argv[1])
gemv.GROUP = cfg.get("group", 1)
gemv.WORDS = cfg.get("words", False)
if cfg.get("no_tensor_cores"):
    gemv.TENSOR_CORE_MIN_FEATURES = 1 << 30
if "block" in cfg:
    gemv._one_byte_config = lambda out_features, in_features: gemv.GemvConfig(*cfg["block"])
from tokenmill import LLM
from decode_rate import decode_rate
llm = LLM(model=os.environ.get("MODEL", "llama-3.1-8b"), load_format="dummy", dtype="bfloat16",
          quantization=cfg["quantization"], max_model_len=512)
rate, rates = decode_rate(llm)
print("RESULT", sys.argv[1], f"{rate:.1f} tok/s", [round(r, 1) for r in rates], flush=True)
"""

VARIANTS = {
    "int8-g1": {"quantization": "int8"},
    "int8-words": {"quantization": "int8", "words": True},
    "int8-g16": {"quantization": "int8", "group": 16},
    "int8-g16-8x2048": {"quantization": "int8", "group": 16, "block": [8, 2048, 4, 2]},
    "fp8-g1": {"quantization": "fp8"},
    "fp8-words": {"quantization": "fp8", "words": True},
}


def main(argv: list[str]) -> None:
    if "kernels" in argv:
        result = subprocess.run(
            [sys.executable, "-c", "import json\n" + PATCH + KERNELS], text=True, timeout=400
        )
        print("kernels exit", result.returncode, flush=True)
    if "engine" in argv:
        names = [a for a in argv if a in VARIANTS] or list(VARIANTS)
        for name in names:
            r = subprocess.run(
                [sys.executable, "-c", PATCH + ENGINE, json.dumps(VARIANTS[name])],
                capture_output=True, text=True, timeout=240,
            )  # fmt: skip
            lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
            print(name, lines[0] if lines else f"FAILED: {r.stderr[-1500:]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
