"""``fused_rows_activation`` on and off (issue 17): the engine's CUDA graphs replayed back to back (decode
graphs of 1-32 rows, the one-sequence prefill graphs of 16 and 32 tokens that speculative verification
steps run through), decode tok/s at 1, 4 and 16 sequences (128-token prompts, 160 greedy tokens, EOS
ignored, median of 3), and the first greedy tokens of 4 rows (the fused epilogue rounds as the kernels it
replaces: the tokens should agree). Dummy weights, bf16, n-gram speculation configured (k = 24) so that
the prefill graphs are captured as a verification step uses them; each variant in a fresh process.

    PYTHONPATH=src python scripts/experiments/rows_activation_graphs_ab.py [VARIANT ...]
"""

import sys

from decode_rate import run_variants

ENGINE = r"""
import sys, json
sys.path.insert(0, HERE)
cfg = json.loads(sys.argv[1])
from tokenmill import LLM, SamplingParams
from decode_rate import decode_rate
from speculative_step_phases import replay_micros
ngram = {"method": "ngram", "num_speculative_tokens": 24}
llm = LLM(model=cfg["model"], load_format="dummy", dtype="bfloat16", max_model_len=512,
          fused_rows_activation=cfg["fused"], speculative_config=ngram)
runner = llm.engine.runner
label = f"{cfg['model']} {'fused' if cfg['fused'] else 'separate'}"
for name, graphs, sizes in (("decode", runner.decode_graphs, (1, 2, 4, 8, 16, 32)),
                            ("prefill", runner.prefill_graphs, (16, 32))):
    for size in sizes:
        graph = graphs.graphs.get(size) if graphs is not None else None
        if graph is None:
            print("RESULT", label, f"{name} graph of {size}: not captured", flush=True)
            continue
        print("RESULT", label, f"{name} graph of {size}: {replay_micros(graph):.1f} us", flush=True)
prompts = [{"prompt_token_ids": list(range(2000 + 11 * r, 2128 + 11 * r))} for r in range(4)]
outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
print("TOKENS", label, [o.outputs[0].token_ids for o in outs], flush=True)
for batch in (1, 4, 16):
    rate, rates = decode_rate(llm, batch=batch)
    rounded = [round(r, 1) for r in rates]
    print("RESULT", label, f"decode batch {batch}: {rate:.1f} tok/s", rounded, flush=True)
"""

VARIANTS = {
    f"{model}-{'fused' if fused else 'separate'}": {"model": model, "fused": fused}
    for model in ("smollm2-135m", "gemma-3-270m")
    for fused in (True, False)
}


def main(argv: list[str]) -> None:
    run_variants(ENGINE, VARIANTS, argv, ("RESULT", "TOKENS"))


if __name__ == "__main__":
    main(sys.argv[1:])
