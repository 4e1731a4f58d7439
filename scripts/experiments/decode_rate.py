"""Decode rate for the engine A/B scripts beside this one (``gemv_engine_ab.py``, ``gemv_rows_graphs_ab.py``,
``split_k_gemv_ab.py``, ``word_gemv_ab.py``): ``batch`` prompts of ``prompt_len`` token ids, ``tokens``
greedy tokens with EOS ignored, the rate from the difference of a ``tokens + 1`` run and a 1-token run (so
prefill and the first token drop out), the median of ``repeats``, after one warm-up run."""

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams


def decode_rate(
    llm: LLM, prompt_len: int = 128, tokens: int = 160, repeats: int = 3, batch: int = 1
) -> tuple[float, list[float]]:
    """(median tok/s, every run's tok/s) over ``batch`` prompts decoded together (all rows' tokens)."""
    prompts = [
        {"prompt_token_ids": list(range(1000 + 7 * r, 1000 + 7 * r + prompt_len))} for r in range(batch)
    ]

    def seconds(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - start

    seconds(tokens)
    rates = [batch * tokens / (seconds(tokens + 1) - seconds(1)) for _ in range(repeats)]
    return statistics.median(rates), rates


def run_variants(engine: str, variants: dict[str, dict], argv: list[str], prefixes: tuple[str, ...]) -> None:
    """Each variant named in ``argv`` (all by default) in a fresh process: ``engine`` is the child's source,
    given ``HERE`` (this folder) and the variant's settings as JSON in ``sys.argv[1]``; its lines starting
    with ``prefixes`` are printed under the variant's name."""
    here = str(Path(__file__).resolve().parent)
    for name in [a for a in argv if a in variants] or list(variants):
        result = subprocess.run(
            [sys.executable, "-c", f"HERE = {here!r}\n" + engine, json.dumps(variants[name])],
            capture_output=True,
            text=True,
            timeout=240,
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith(prefixes)]
        print(name, "\n  ".join(lines) if lines else f"FAILED: {result.stderr[-1500:]}", flush=True)
