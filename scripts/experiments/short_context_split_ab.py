"""Exploration for issue 18 on an H100/H200: batch-1 decode of dummy llama-3.1-8b (128-token prompt, 160
tokens, median of 3, each variant in a fresh process) with decode attention split at short contexts.

The landed plan keeps a context of up to ``DECODE_MAX_UNSPLIT`` (256) keys in one partition: at batch 1
that is one program per KV head walking its keys tile by tile (~10 µs a layer at ~200 keys,
``reports/gpu/quantized-llama-3.1-8b/decode-profile/``). A variant ``uU-pP`` sets ``DECODE_MAX_UNSPLIT``
to U and ``DECODE_MIN_PARTITION`` to P, so such contexts are cut into partitions of P keys that run in
parallel and are merged by the last to arrive. The greedy tokens of a 24-token run are printed so that
variants can be compared.

    PYTHONPATH=src python scripts/experiments/short_context_split_ab.py [VARIANT ...]
"""

import sys

from decode_rate import run_variants

ENGINE = r"""
import sys, json
sys.path.insert(0, HERE)
from tokenmill.kernels.attention import plan
cfg = json.loads(sys.argv[1])
plan.DECODE_MAX_UNSPLIT = cfg.get("max_unsplit", plan.DECODE_MAX_UNSPLIT)
plan.DECODE_MIN_PARTITION = cfg.get("min_partition", plan.DECODE_MIN_PARTITION)
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


def _variants() -> dict[str, dict]:
    variants = {}
    for quantization in ("int8", "none"):
        variants[f"{quantization}-landed"] = {"quantization": quantization}
        for unsplit, partition in ((0, 128), (0, 64), (128, 64)):
            name = f"{quantization}-u{unsplit}-p{partition}"
            variants[name] = {"quantization": quantization, "max_unsplit": unsplit, "min_partition": partition}
    return variants


VARIANTS = _variants()


def main(argv: list[str]) -> None:
    run_variants(ENGINE, VARIANTS, argv, ("RESULT", "TOKENS"))


if __name__ == "__main__":
    main(sys.argv[1:])
