"""Exploration for issue 18 on an H100/H200: batch-1 decode with and without ``l2_prefetch`` (the decode
attention kernel pulling the output projection's weight into L2, ``tokenmill.kernels.l2_prefetch``), for
dummy llama-3.1-8b in bf16 / int8 / fp8 and llama-3.2-1b in bf16: 128-token prompt, 160 tokens, median of
3, each variant in a fresh process, the two settings alternating. The first 8 greedy tokens of each run
are printed: a hint changes no result, so they must agree.

``MODEL:QUANT:PIECES:AFTER_WAIT`` adds a run with that many bulk prefetches per idle program, issued
before or after the program waits for the kernel ahead (1 or 0).

    PYTHONPATH=src python scripts/experiments/l2_prefetch_ab.py [MAX_MODEL_LEN [MODEL:QUANT[:P:A] ...]]
"""

import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent

ENGINE = r"""
import sys, json
sys.path.insert(0, HERE)
from tokenmill import LLM, SamplingParams
from decode_rate import decode_rate
cfg = json.loads(sys.argv[1])
from tokenmill.kernels.attention import decode
decode.PREFETCH_PIECES, decode.PREFETCH_AFTER_WAIT = cfg.get("pieces", 1), cfg.get("after_wait", False)
llm = LLM(model=cfg["model"], load_format="dummy", dtype="bfloat16", quantization=cfg["quantization"],
          max_model_len=cfg["max_model_len"], l2_prefetch=cfg["l2_prefetch"])
assert llm.engine.runner.backend.l2_prefetch == cfg["l2_prefetch"]
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
first = llm.generate([{"prompt_token_ids": list(range(1000, 1128))}], params)[0].outputs[0].token_ids
rate, rates = decode_rate(llm)
print("RESULT", sys.argv[1], f"{rate:.1f} tok/s", [round(r, 1) for r in rates], "tokens", list(first))
"""

DEFAULT_RUNS = ["llama-3.2-1b:none", "llama-3.1-8b:int8", "llama-3.1-8b:fp8", "llama-3.1-8b:none"]


def main(argv: list[str]) -> None:
    max_model_len = int(argv[0]) if argv else 4096
    prefix = f"HERE = {str(HERE)!r}\n"
    for run in argv[1:] or DEFAULT_RUNS:
        model, quantization, *knobs = run.split(":")
        settings = (
            [(True, int(knobs[0]), knobs[1] == "1")] if knobs else [(False, 0, False), (True, 1, False)]
        )
        for prefetch, pieces, after_wait in settings:
            variant = {"model": model, "quantization": quantization, "l2_prefetch": prefetch,
                       "max_model_len": max_model_len, "pieces": pieces,
                       "after_wait": after_wait}  # fmt: skip
            r = subprocess.run(
                [sys.executable, "-c", prefix + ENGINE, json.dumps(variant)], capture_output=True, text=True,
                timeout=240,
            )  # fmt: skip
            lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
            print(lines[0] if lines else f"FAILED {variant}: {r.stderr[-1500:]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
