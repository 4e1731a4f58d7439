"""Decode rate of one engine under greedy, temperature and top-p sampling (dummy weights, no EOS).

For comparing sampler changes run to run (e.g. the top-p kernel against the sorting filter it replaced):
each mode runs the same requests on one engine, the modes interleaved over ``rounds``.

    python scripts/experiments/top_p_decode_rate.py [PRESET] [BATCH] [MAX_TOKENS] [ROUNDS]
"""

import statistics
import sys
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.report import detect_hardware, provenance_header

MODES = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "top-k 50 + top-p 0.95": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
}


def main(preset: str, batch: int, max_tokens: int, rounds: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(provenance_header(detect_hardware(torch.device(device))), flush=True)
    llm = LLM(preset, load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32")
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(64)] for i in range(batch)]
    print(f"- workload: dummy {preset}, {batch} requests of 64 prompt tokens, {max_tokens} out, no EOS\n")
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = {name: SamplingParams(max_tokens=max_tokens, ignore_eos=True, **f) for name, f in MODES.items()}
    for mode in params.values():
        llm.generate(requests, mode)  # warm up: every sampler variant compiled, the prompts cached
    rates: dict[str, list[float]] = {name: [] for name in MODES}
    for _ in range(rounds):  # the modes interleaved, so drift spreads over all of them
        for name, mode in params.items():
            started = time.perf_counter()
            outputs = llm.generate(requests, mode)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[name].append(tokens / (time.perf_counter() - started))
    print(f"| mode | output tok/s, median of {rounds} | each round |\n| --- | --- | --- |")
    for name, values in rates.items():
        rounded = ", ".join(f"{v:,.0f}" for v in values)
        print(f"| {name} | {statistics.median(values):,.0f} | {rounded} |", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0] if args else "llama-3.2-1b",
        int(args[1]) if len(args) > 1 else 64,
        int(args[2]) if len(args) > 2 else 128,
        int(args[3]) if len(args) > 3 else 3,
    )
