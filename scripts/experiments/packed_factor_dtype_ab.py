"""Exploration (CPU): batch-1 decode of the default model with GGUF's float16 group factors (landed) or float32
ones (``python scripts/experiments/packed_factor_dtype_ab.py half|float``; alternate the two). Not kept."""

import statistics
import sys
import time

import tokenmill.quantization.gguf_packed as gp
from tokenmill import LLM, SamplingParams

orig = gp._compact
mode = sys.argv[1]
if mode == "float":
    gp._compact = lambda factors: factors
llm = LLM(dtype="float32")
p = SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True)
prompt = "Write a short story about a robot who learns to paint."
llm.generate([prompt], p)
rates = []
for _ in range(3):
    t = time.perf_counter()
    a = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    out = llm.generate([prompt], p)
    t2 = time.perf_counter() - t
    rates.append(128 / (t2 - t1))
print(
    mode,
    f"{statistics.median(rates):.1f} tok/s",
    [round(r, 1) for r in rates],
    out[0].outputs[0].token_ids[:12],
)
