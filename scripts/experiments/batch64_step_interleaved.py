"""Exploration for issue 17 (CPU): does an n-gram proposer cost anything at batch 64, where no step
speculates? `bench speculative` times whole runs of the batch, off and on alternately; on the 2-core VM a
run takes ~50 s and the machine's speed drifts by 10-20% over minutes, so its on / off ratio moved
0.79-1.12x between runs and rounds. Here the same 64 open-ended requests go to an engine with speculation
off and one with n-gram speculation on (auto k, auto cutoff), and their steps alternate one by one (which
engine steps first alternates too): each engine's step times are taken in the same seconds.

    PYTHONPATH=src python scripts/experiments/batch64_step_interleaved.py [max_tokens] [repeats]
"""

import statistics
import sys
import time

from tokenmill.benchmarks.speculative import prompts
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading.loader import load_model
from tokenmill.sampling_params import SamplingParams


def main(max_tokens: int, repeats: int) -> None:
    loaded = load_model(None, device="cpu", dtype="float32")
    assert loaded.tokenizer is not None
    base = EngineConfig(device="cpu")
    engines = {
        "off": LLMEngine(base, loaded=loaded),
        "on": LLMEngine(base.with_options(speculative_method="ngram"), loaded=loaded),
    }
    chat = loaded.tokenizer.apply_chat_template
    chats = [chat([{"role": "user", "content": text}], True, tokenize=True) for text in prompts.open_ended(64)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(repeats):
        for engine in engines.values():
            for index, prompt in enumerate(chats):
                engine.add_request(f"{repeat}-{index}", prompt, params)
        first = True  # the prefill step is left out
        while any(engine.has_unfinished_requests() for engine in engines.values()):
            order = list(engines.items())
            if len(times["off"]) % 2:
                order.reverse()
            for name, engine in order:
                if engine.has_unfinished_requests():
                    started = time.perf_counter()
                    engine.step()
                    if not first:
                        times[name].append(time.perf_counter() - started)
            first = False
    for name, steps in times.items():
        print(f"{name}: {len(steps)} decode steps, median {statistics.median(steps) * 1e3:.2f} ms, "
              f"mean {statistics.mean(steps) * 1e3:.2f} ms")  # fmt: skip
    print(f"on / off, median step: {statistics.median(times['on']) / statistics.median(times['off']):.4f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 48, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
