"""Greedy workloads for speculative-decoding tests: prompts that prompt lookup can guess from, added to
an engine a few at a time (continuous batching)."""

import random

from tokenmill import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine


def repetitive_workload(rng: random.Random, count: int) -> dict[str, tuple[list[int], int]]:
    """Prompts that repeat a short pattern (prompt lookup finds it), and some that do not."""
    workload = {}
    for i in range(count):
        pattern = [rng.randrange(3, 384) for _ in range(rng.randint(2, 5))]
        noise = [rng.randrange(3, 384) for _ in range(rng.randint(1, 6))]
        prompt = noise + pattern * rng.randint(2, 4) if i % 3 else noise * 2
        workload[f"r{i}"] = (prompt, rng.randint(4, 24))
    return workload


def run_workload(
    engine: LLMEngine, workload: dict[str, tuple[list[int], int]], seed: int = 0
) -> dict[str, list[int]]:
    """Add the requests a few at a time between steps (continuous batching); greedy, EOS ignored."""
    rng = random.Random(seed)
    arrivals = list(workload)
    outputs: dict[str, list[int]] = {rid: [] for rid in workload}
    while arrivals or engine.has_unfinished_requests():
        for _ in range(rng.randint(1, 3)):
            if arrivals:
                rid = arrivals.pop(0)
                prompt, max_tokens = workload[rid]
                engine.add_request(
                    rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                )
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    return outputs
