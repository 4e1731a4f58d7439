"""Exploration for issue 16: does llguidance's batched mask fill spread over threads on this workload?

64 rows under ``endless(NESTED)`` (the `bench structured` constraint), each walked along a fixed random path
of allowed tokens (the same paths for every variant, so every variant sees the same states); per step the
64 masks are filled one way and timed. Matchers are rebuilt for every variant (a matcher remembers the
masks it has computed). Variants: ``serial`` (a loop of one-row fills, also giving each row's time),
``executor-N`` (llguidance's LLExecutor with N threads over matchers built apart), ``copies-N`` (the same
over deep copies of one matcher, which share its lexer behind a lock), ``pool-N`` (N Python threads,
each filling its share of rows one at a time; the one-row fill releases the GIL).

    python scripts/experiments/structured_fill_threads.py [TOKENIZER_FOLDER] [steps] [vocab]
"""

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from tokenmill.benchmarks.structured.schemas import NESTED, endless
from tokenmill.loading.loader import load_tokenizer
from tokenmill.structured.backend import Vocabulary
from tokenmill.structured.llguidance_backend import LLGuidanceBackend, _grammar_text
from tokenmill.structured.params import StructuredOutputsParams

ROWS = 64


def tokenizer_for(folder: str | None):
    if folder:
        return load_tokenizer(folder)
    from tokenmill.loading.source import resolve_source

    return resolve_source(None).tokenizer()


def main(argv: list[str]) -> None:
    folder = argv[0] if argv and argv[0] != "-" else None
    steps = int(argv[1]) if len(argv) > 1 else 40
    tokenizer = tokenizer_for(folder)
    vocab = int(argv[2]) if len(argv) > 2 else 128256
    eos = (tokenizer.eos_token_id,)
    backend = LLGuidanceBackend(Vocabulary(tokenizer.hf_tokenizer, vocab, eos))
    grammar = _grammar_text(StructuredOutputsParams(json=endless(NESTED)).spec())
    words = -(-vocab // 32)
    masks = torch.zeros(ROWS, words, dtype=torch.int32)

    def fresh() -> list[llguidance.LLMatcher]:
        return [llguidance.LLMatcher(backend.tokenizer, grammar) for _ in range(ROWS)]

    executor = llguidance.LLExecutor()
    rng = np.random.default_rng(0)
    matchers = fresh()
    paths: list[list[int]] = [[] for _ in range(ROWS)]
    for _ in range(steps):
        executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], masks.data_ptr(), words * 4, ROWS
        )
        bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")
        for i, m in enumerate(matchers):
            token = int(rng.choice(np.flatnonzero(bits[i])))
            assert m.consume_token(token)
            paths[i].append(token)
    print(f"{ROWS} rows, {steps} steps, vocab {vocab}; example path: {tokenizer.decode(paths[0])!r}")

    def fill_serial(ms, row_times):
        for i, m in enumerate(ms):
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(masks[i].data_ptr(), words * 4)
            row_times.append(time.perf_counter() - t)

    def run(name: str, make, fill) -> None:
        ms = make()
        step_times, row_times = [], []
        for step in range(steps):
            t = time.perf_counter()
            fill(ms, row_times)
            step_times.append(time.perf_counter() - t)
            for i, m in enumerate(ms):
                m.consume_token(paths[i][step])
        median, mean = statistics.median(step_times) * 1e3, statistics.mean(step_times) * 1e3
        line = f"{name:12} per step: median {median:6.2f} ms, mean {mean:6.2f}"
        if row_times:
            r = sorted(row_times)
            p50, p90, top = r[len(r) // 2] * 1e6, r[int(len(r) * 0.9)] * 1e6, r[-1] * 1e6
            line += f"; rows: median {p50:.0f} us, p90 {p90:.0f}, max {top:.0f}, mean {statistics.mean(r) * 1e6:.0f}"
        print(line, flush=True)

    import os

    cores = os.cpu_count() or 2
    run("serial", fresh, fill_serial)
    counts = sorted({n for n in (1, 2, 4, 8, 12, 16) if n <= cores} | {max(1, cores * 80 // 100)})
    for n in counts:
        ex = llguidance.LLExecutor(n)
        run(
            f"executor-{n}",
            fresh,
            lambda ms, _, ex=ex: ex.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(ms)], masks.data_ptr(), words * 4, ROWS
            ),
        )
    for n in counts[-1:]:
        ex = llguidance.LLExecutor(n)
        pristine = llguidance.LLMatcher(backend.tokenizer, grammar)
        run(
            f"copies-{n}",
            lambda: [pristine.deep_copy() for _ in range(ROWS)],
            lambda ms, _, ex=ex: ex.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(ms)], masks.data_ptr(), words * 4, ROWS
            ),
        )
    for n in counts[-2:]:
        pool = ThreadPoolExecutor(n)

        def pooled(ms, _, n=n, pool=pool):
            def part(k):
                for i in range(k, ROWS, n):
                    ms[i].unsafe_compute_mask_ptr(masks[i].data_ptr(), words * 4)

            list(pool.map(part, range(n)))

        run(f"pool-{n}", fresh, pooled)


if __name__ == "__main__":
    main(sys.argv[1:])
