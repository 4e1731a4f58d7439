"""Exploration (CPU, packed GGUF default): decode of the default model with the 4-bit codes unpacked the old
way (split the nibbles of 16 bytes, then widen each half: six shuffles a group) or the landed one (widen
each byte once, mask and shift: two), in fresh processes, alternating, same prompt and greedy tokens:
``python scripts/experiments/packed_nibble_unpack_ab.py [rounds]``. The old source is read from git."""

import json
import statistics
import subprocess
import sys

OLD_COMMIT = "ee536b8"
CHILD = r"""
import json, subprocess, sys, time
import tokenmill.quantization.gguf_cpu_kernel as K
if sys.argv[1] == "old":
    text = subprocess.run(["git", "show", sys.argv[2] + ":src/tokenmill/quantization/gguf_cpu_kernel.py"],
                          capture_output=True, text=True, check=True).stdout
    namespace = {}
    exec(text.split("\n\n\n@cache", 1)[0], namespace)  # the old module up to load_kernel: its _SOURCE
    K._SOURCE = namespace["_SOURCE"]
from tokenmill import LLM, SamplingParams
llm = LLM(dtype="float32")
prompt = "Write a short story about a robot who learns to paint."
rates = {}
for batch in (1, 8):
    p = SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt] * batch, p)
    t = time.perf_counter(); llm.generate([prompt] * batch, one); t1 = time.perf_counter() - t
    t = time.perf_counter(); out = llm.generate([prompt] * batch, p); t2 = time.perf_counter() - t
    rates[batch] = 128 * batch / (t2 - t1)
print(json.dumps({"rates": rates, "tokens": out[0].outputs[0].token_ids[:16]}))
"""


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for _ in range(rounds):
        for mode in ("old", "new"):
            run = subprocess.run(
                [sys.executable, "-c", CHILD, mode, OLD_COMMIT], capture_output=True, text=True
            )
            if run.returncode:
                sys.exit(run.stderr[-3000:])
            results[mode].append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(mode, results[mode][-1], flush=True)
    for mode, runs in results.items():
        for batch in ("1", "8"):
            values = [r["rates"][batch] for r in runs]
            print(
                f"{mode} batch {batch}: median {statistics.median(values):.1f} tok/s {[round(v, 1) for v in values]}"
            )
    print(
        "tokens equal:",
        all(r["tokens"] == results["old"][0]["tokens"] for runs in results.values() for r in runs),
    )


if __name__ == "__main__":
    main()
