"""Exploration for issue 17: the step sequence of batch-1 n-gram speculation on the GPU, simulated on the
greedy outputs of `bench speculative`'s prompts (the default model on the CPU, float32), under the policy
that drops a started step when guesses come (``drop``) and the one that defers the guesses (``defer``,
``speculative/guessing.py``). Counts verification steps (V), plain steps started ahead (PS), plain steps
run at once (P) and dropped started steps (D), and prices them with the given costs in ms
(defaults: the H200 phases of the real SmolLM2, this report's phases.txt, and the 0.45 ms of GPU work of a
dropped one-row decode graph):

    python scripts/experiments/speculative_policy_sim.py [--k 24] [--costs V=1.24,PS=0.50,P=0.81,D=0.45]
"""

import argparse

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.speculative import prompts
from tokenmill.speculative.ngram import lookup


def simulate(prompt: list[int], output: list[int], k: int, defer: bool) -> tuple[dict[str, int], int]:
    """Step kinds of one greedy request, and the tokens its verification steps emitted."""
    known, n, started = [*prompt, output[0]], 1, False  # the prefill samples the first token
    counts = dict.fromkeys(("V", "PS", "P", "D"), 0)
    emitted = 0
    while n < len(output):
        limit = min(k, len(output) - n - 1)
        guesses = lookup(known, 2, 4, limit) if limit > 0 else []
        if guesses and not (defer and started):
            counts["D"] += started
            accepted = 0
            while accepted < len(guesses) and guesses[accepted] == output[n + accepted]:
                accepted += 1
            count = min(accepted + 1, len(output) - n)
            counts["V"] += 1
            emitted += count
            known += output[n : n + count]
            n += count
            started = False
            continue
        counts["PS" if started else "P"] += 1
        known.append(output[n])
        n += 1
        started = not guesses  # deferred guesses: the next step is not started ahead
    return counts, emitted


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--k", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--costs", default="V=1.24,PS=0.50,P=0.81,D=0.45")
    args = parser.parse_args()
    costs = {key: float(value) for key, value in (item.split("=") for item in args.costs.split(","))}
    llm = LLM()
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for name, texts in (("code editing", prompts.CODE_EDITING), ("copy mix", prompts.COPY_MIX)):
        requests = []
        for text in texts:
            out = llm.chat([{"role": "user", "content": text}], greedy)[0]
            requests.append((list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
        for defer in (False, True):
            total = dict.fromkeys(("V", "PS", "P", "D"), 0)
            emitted = tokens = 0
            for prompt, output in requests:
                counts, count = simulate(prompt, output, args.k, defer)
                total = {key: total[key] + counts[key] for key in total}
                emitted += count
                tokens += len(output) - 1
            cost = sum(total[key] * costs[key] for key in total)
            print(
                f"{name:12s} {'defer' if defer else 'drop':5s} {total} tokens {tokens}, per verification "
                f"{emitted / max(total['V'], 1):.2f}; priced: {tokens * costs['PS'] / cost:.2f}x"
            )


if __name__ == "__main__":
    main()
