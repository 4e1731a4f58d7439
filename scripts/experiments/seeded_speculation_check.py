"""Check on a GPU (issue 17): a seeded request's sampled tokens are the same with n-gram speculation on
and off, now that guesses are decided by the plain steps' own draw (on CUDA the fused sampling kernel's).
The default model in float32 (so the verification and decode paths' logits agree closely), copy-heavy
prompts one at a time (batch 1, where a GPU engine speculates), temperature 0.8, a seed each.

    PYTHONPATH=src python scripts/experiments/seeded_speculation_check.py [--device cuda]
"""

import argparse

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "Copy this sentence exactly: the red car drove to the old market and the red car drove back. Copy:",
    "Rename the function foo to bar:\ndef foo(x):\n    return foo_helper(x) + 1\n\ndef foo_helper(y):\n"
    "    return y * 2\nAnswer:\n",
    "List the words again, in the same order: apple, river, stone, apple, river, cloud, stone. Again:",
    "Repeat after me: one two three four five six seven eight nine ten. Now you:",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument(
        "--dummy", action="store_true", help="random weights, token-id prompts, temperature 0.1"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    outputs = {}
    prompts: list = list(PROMPTS)
    temperature, loading = 0.8, {}
    if args.dummy:  # a repeated pattern of ids, which random weights tend to go on repeating
        prompts = [{"prompt_token_ids": [100 + i, 7, 8] + [200 + i, 300, 400, 500] * 6} for i in range(4)]
        temperature, loading = 0.1, {"load_format": "dummy"}
    for label, options in (("off", {}), ("on", {"speculative_config": {"method": "ngram"}})):
        memory = {"num_kv_blocks": 1024} if args.device == "cuda" else {}  # two engines in one process
        llm = LLM(args.model, device=args.device, dtype="float32", **loading, **memory, **options)
        outputs[label] = [
            llm.generate(
                prompt, SamplingParams(temperature=temperature, seed=11 + i, max_tokens=args.max_tokens)
            )[0]
            for i, prompt in enumerate(prompts)
        ]
        if label == "on":
            stats = llm.scheduler_stats().spec_decode
            print(f"speculation: {stats.num_proposed} proposed, {stats.num_accepted} accepted, "
                  f"{stats.num_steps} verification steps")  # fmt: skip
    same = 0
    for i, (off, on) in enumerate(zip(outputs["off"], outputs["on"], strict=True)):
        a, b = off.outputs[0].token_ids, on.outputs[0].token_ids
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        same += a == b
        print(f"prompt {i}: {len(a)} / {len(b)} tokens, " + ("identical" if a == b else f"differ at {first}"))
    print(f"seeded outputs identical with speculation on and off: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
