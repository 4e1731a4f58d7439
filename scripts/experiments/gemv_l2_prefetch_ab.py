"""Exploration for issue 18 on an H100/H200: batch-1 decode of dummy llama-3.1-8b (128-token prompt, 160
tokens, median of 3, each variant in a fresh process) with each CUDA-core GEMV program bulk-prefetching its
own weight rows into L2 before its programmatic-launch wait (``kernels/gemv.py``'s
``L2_PREFETCH_PIECES``: 0 = off, else that many ``cp.async.bulk.prefetch.L2`` slices a program).

Inside the engine the q/k/v GEMV takes ~14.6 µs a layer where it takes 10.9 alone
(``reports/gpu/quantized-llama-3.1-8b/short-context-split/``): its programs load one weight tile, then
wait for the previous kernel. The prefetch asks for the rest of their rows while they wait.

    PYTHONPATH=src python scripts/experiments/gemv_l2_prefetch_ab.py [VARIANT ...]
"""

import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent

ENGINE = r"""
import sys, json
sys.path.insert(0, HERE)
from tokenmill.kernels import gemv
cfg = json.loads(sys.argv[1])
gemv.L2_PREFETCH_PIECES = cfg.get("pieces", 0)
from tokenmill import LLM, SamplingParams
from decode_rate import decode_rate
llm = LLM(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16", quantization=cfg["quantization"],
          max_model_len=512)
rate, rates = decode_rate(llm)
ids = list(range(1000, 1128))
tokens = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
print("RESULT", sys.argv[1], f"{rate:.1f} tok/s", [round(r, 1) for r in rates], flush=True)
print("TOKENS", sys.argv[1], tokens[0].outputs[0].token_ids, flush=True)
"""

VARIANTS = {
    f"{quantization}-p{pieces}": {"quantization": quantization, "pieces": pieces}
    for quantization in ("int8", "fp8", "none")
    for pieces in (0, 4, 32, 128)
}


def main(argv: list[str]) -> None:
    for name in [a for a in argv if a in VARIANTS] or list(VARIANTS):
        r = subprocess.run(
            [sys.executable, "-c", f"HERE = {str(HERE)!r}\n" + ENGINE, json.dumps(VARIANTS[name])],
            capture_output=True,
            text=True,
            timeout=240,
        )
        lines = [line for line in r.stdout.splitlines() if line.startswith(("RESULT", "TOKENS"))]
        print(name, "\n  ".join(lines) if lines else f"FAILED: {r.stderr[-1500:]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
