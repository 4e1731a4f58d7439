"""Exploration for issue 16: how often a real model's own choice already obeys the grammar, and what a
mask costs in the states a real model reaches (against those of the dummy-weight benchmark).

Real SmolLM2 (the default model, float32 on the CPU): chat prompts that ask for the benchmark's nested
schema, greedy, constrained. Then
  * agreement: each output teacher-forced through the model unconstrained (``prompt_logprobs``); a
    position whose rank-1 token is the constrained choice is a step where sampling first and checking the
    token with the matcher would have needed no mask;
  * mask time: each output replayed through a fresh matcher, one row's mask timed at every position.

    PYTHONPATH=src python scripts/experiments/structured_real_states.py [--prompts 8] [--max-tokens 200]
"""

import argparse
import statistics
import time

import torch

from tokenmill.benchmarks.structured.schemas import NESTED
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.backend import bitmask_width
from tokenmill.structured.params import StructuredOutputsParams

SUBJECTS = [
    "a customer of an online bookshop",
    "an administrator of a small web forum",
    "a viewer who just signed up to a video site",
    "an editor at a newspaper in Berlin",
    "a retired teacher who buys garden tools",
    "a student who orders lab equipment",
    "a chef who buys knives and spices",
    "a photographer in Lisbon",
    "a nurse in Toronto who orders books",
    "a software engineer in Nairobi",
    "a farmer who orders seeds",
    "a musician who buys guitar strings",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = LLM(dtype="float32")
    conversations = [
        [{"role": "user", "content": f"Write a JSON record for {subject}: id, name, email, role, tags, "
          "address (street, city, zip), orders (sku, quantity, cents) and active."}]
        for subject in SUBJECTS[: args.prompts]
    ]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(json=NESTED)
    )
    outputs = llm.chat(conversations, constrained)
    agree = total = 0
    for output in outputs:
        ids = output.prompt_token_ids + output.outputs[0].token_ids
        forced = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))
        ranks = [
            position[token].rank
            for position, token in zip(forced[0].prompt_logprobs[len(output.prompt_token_ids):],
                                       output.outputs[0].token_ids, strict=True)
        ]
        agree += sum(rank == 1 for rank in ranks)
        total += len(ranks)
        print(f"{len(ranks):4d} tokens, {sum(rank == 1 for rank in ranks) / len(ranks):.1%} rank 1: "
              f"{output.outputs[0].text[:90]!r}")
    print(f"agreement: {agree}/{total} = {agree / total:.1%} of constrained tokens were the model's own argmax")

    structured = llm.engine.structured_outputs
    backend = structured.backend
    grammar = structured.compile(StructuredOutputsParams(json=NESTED))
    bitmask = torch.zeros(1, bitmask_width(structured.vocab_size), dtype=torch.int32)
    times = []
    for output in outputs:
        matcher = grammar.matcher()
        for token in output.outputs[0].token_ids:
            start = time.perf_counter()
            backend.fill_bitmasks([(matcher, 0)], bitmask)
            times.append(time.perf_counter() - start)
            if not matcher.accept_token(token):
                break
    times.sort()
    print(
        f"one-row mask in the real model's states: {len(times)} masks, mean {statistics.mean(times) * 1e6:.1f} "
        f"µs, p50 {times[len(times) // 2] * 1e6:.1f}, p90 {times[int(len(times) * 0.9)] * 1e6:.1f}, "
        f"p99 {times[int(len(times) * 0.99)] * 1e6:.1f}"
    )


if __name__ == "__main__":
    main()
