"""A warm start: run the kernels the engine can hit before the first request, so it does not pay for them.

Triton compiles a kernel the first time it launches with a new specialization (its constexprs, and
whether each integer argument is 1 or a multiple of 16), and cuBLAS picks its algorithms on first use
of a shape. So before serving, the engine runs a few synthetic requests through its own path: prompts
of bucketed lengths (one token, block-aligned, unaligned), prompts that overflow a step's token budget
(so chunked prefill continues from cached context) and a repeat for a prefix-cache hit, prefills
beside running decodes, decode batches wider than the graphs that compute logits, and each sampling
path (greedy, top-k / top-p, min-p, logprobs, penalties). The decode graphs themselves were compiled
when they were captured.

Compiled kernels land in Triton's on-disk cache (``~/.triton/cache``, or ``TRITON_CACHE_DIR``), so a
later start only loads them. Afterwards the engine forgets the synthetic prompts: the prefix cache is
emptied and the scheduler's counters reset.
"""

from dataclasses import dataclass

import torch

from tokenmill.runner.cuda_graphs import GRAPH_LOGITS_MAX_ROWS
from tokenmill.sampling_params import SamplingParams

# Prompt lengths (tokens) that reach the prefill kernels' specializations: one token, unaligned, aligned.
PROMPT_LENGTHS = (1, 3, 16, 17, 100, 128, 500)
WARM_TOKENS = 4  # tokens generated per synthetic request: enough for decode steps of every batch
_SAMPLING: tuple[SamplingParams, ...] = (
    SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=WARM_TOKENS, ignore_eos=True, seed=1),
    SamplingParams(temperature=1.0, min_p=0.05, max_tokens=WARM_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.0, logprobs=2, max_tokens=WARM_TOKENS, ignore_eos=True),
    SamplingParams(
        temperature=0.7, presence_penalty=0.5, repetition_penalty=1.1, max_tokens=WARM_TOKENS, ignore_eos=True
    ),
)


@dataclass(frozen=True)
class WarmStartReport:
    num_requests: int
    num_steps: int
    seconds: float

    def describe(self) -> str:
        return f"warm-up {self.seconds:.1f} s ({self.num_requests} requests, {self.num_steps} steps)"


def warm_up_waves(
    max_tokens_per_seq: int, token_budget: int, max_running: int, vocab_size: int
) -> list[list[tuple[str, list[int], SamplingParams]]]:
    """The synthetic requests (id, prompt token ids, sampling) in waves: each wave is admitted one step
    after the one before, so its prefill runs beside their decodes (mixed steps). ``max_tokens_per_seq``:
    the most tokens one sequence may hold (the model length, or the KV pool if smaller)."""
    generator = torch.Generator().manual_seed(0)
    longest = max_tokens_per_seq - WARM_TOKENS
    if longest < 1:
        return []

    def prompt(length: int) -> list[int]:
        return torch.randint(0, vocab_size, (min(length, longest),), generator=generator).tolist()

    lengths = sorted({min(length, longest) for length in PROMPT_LENGTHS})
    # Prompts that together overflow one step's budget, so the last is split and continues from its KV.
    overflow = [prompt(longest) for _ in range(min(max_running, token_budget // longest + 2))]
    waves = [
        [prompt(length) for length in lengths],
        [prompt(lengths[-1]) for _ in _SAMPLING],
        overflow,
        [list(overflow[0])],  # a prefix-cache hit: its blocks are cached by now
        # More rows than the decode graphs take logits for (they then run after the replay).
        [prompt(3) for _ in range(min(max_running, 2 * GRAPH_LOGITS_MAX_ROWS + 1))],
    ]
    return [
        [(f"warm-up-{w}-{i}", ids, _SAMPLING[(w + i) % len(_SAMPLING)]) for i, ids in enumerate(wave)]
        for w, wave in enumerate(waves)
    ]
