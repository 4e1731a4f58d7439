"""Exploration for issue 17: the step sequence of batch-1 n-gram speculation on the GPU, simulated on the
greedy outputs of `bench speculative`'s prompts (the default model on the CPU, float32), under the policy
that drops a started step when guesses come (``drop``) and the one that defers the guesses (``defer``,
``speculative/guessing.py``). Counts verification steps (V), plain steps started ahead (PS), plain steps
run at once (P) and dropped started steps (D), and prices them with the given costs in ms
(defaults: the H200 phases of the real SmolLM2, this report's phases.txt, and the 0.45 ms of GPU work of a
dropped one-row decode graph):

    python scripts/experiments/speculative_policy_sim.py [--k 24] [--costs V=1.24,PS=0.50,P=0.81,D=0.45]

With ``--oracle``, also an upper bound on what choosing when to guess can buy: the deferral policy where a
guess is verified only if at least T of its tokens will be accepted (known here from the output, T = 1-4),
with prompt lookup from n = 2 (the default) or n = 1, and for each policy the verification step cost (ms,
the other costs as given) at which the run would reach ``--target`` (2.5x).
"""

import argparse

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.speculative import prompts
from tokenmill.speculative.ngram import lookup


def simulate(
    prompt: list[int], output: list[int], k: int, defer: bool, oracle: int = 0, min_n: int = 2
) -> tuple[dict[str, int], int]:
    """Step kinds of one greedy request, and the tokens its verification steps emitted; with ``oracle``,
    guesses that would keep fewer than that many tokens are not made."""
    known, n, started = [*prompt, output[0]], 1, False  # the prefill samples the first token
    counts = dict.fromkeys(("V", "PS", "P", "D"), 0)
    emitted = 0
    while n < len(output):
        limit = min(k, len(output) - n - 1)
        guesses = lookup(known, min_n, 4, limit) if limit > 0 else []
        accepted = 0
        while accepted < len(guesses) and guesses[accepted] == output[n + accepted]:
            accepted += 1
        if accepted < oracle:
            guesses = []
        if guesses and not (defer and started):
            counts["D"] += started
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
    parser.add_argument("--oracle", action="store_true", help="the bound of an oracle gate on guesses")
    parser.add_argument("--target", type=float, default=2.5)
    args = parser.parse_args()
    costs = {key: float(value) for key, value in (item.split("=") for item in args.costs.split(","))}
    llm = LLM()
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for name, texts in (("code editing", prompts.CODE_EDITING), ("copy mix", prompts.COPY_MIX)):
        requests = []
        for text in texts:
            out = llm.chat([{"role": "user", "content": text}], greedy)[0]
            requests.append((list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
        policies = [("drop", False, 0, 2), ("defer", True, 0, 2)]
        if args.oracle:
            policies += [(f"oracle>={t} n>={n}", True, t, n) for t in (1, 2, 3, 4) for n in (2, 1)]
        for label, defer, oracle, min_n in policies:
            total = dict.fromkeys(("V", "PS", "P", "D"), 0)
            emitted = tokens = 0
            for prompt, output in requests:
                counts, count = simulate(prompt, output, args.k, defer, oracle, min_n)
                total = {key: total[key] + counts[key] for key in total}
                emitted += count
                tokens += len(output) - 1
            cost = sum(total[key] * costs[key] for key in total)
            others = cost - total["V"] * costs["V"]
            needed = (tokens * costs["PS"] / args.target - others) / max(total["V"], 1)
            print(
                f"{name:12s} {label:15s} {total} tokens {tokens}, per verification "
                f"{emitted / max(total['V'], 1):.2f}; priced: {tokens * costs['PS'] / cost:.2f}x; "
                f"{args.target}x needs V <= {needed:.2f} ms"
            )


if __name__ == "__main__":
    main()
