"""A warm start: run the kernels the engine can hit before the first request, so it does not pay for them.

Triton compiles a kernel the first time it launches with a new specialization (its constexprs, and
whether each integer argument is 1 or a multiple of 16), and cuBLAS picks its algorithms on first use
of a shape. So before serving, the engine runs a few synthetic requests through its own path: prompts
of bucketed lengths (short, block-aligned, unaligned, one longer than a step's token budget, so that
chunked prefill continues from cached context, and one repeating another for a prefix-cache hit), decode
steps at growing batch sizes, and each sampling path (greedy, sampled with top-k / top-p, logprobs,
penalties). The decode batch sizes themselves were compiled when the CUDA graphs were captured.

Compiled kernels land in Triton's on-disk cache (``~/.triton/cache``, or ``TRITON_CACHE_DIR``), so a
later start only loads them. Afterwards the engine forgets the synthetic prompts: the prefix cache is
emptied and the scheduler's counters reset.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

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


def warm_up_requests(
    max_model_len: int, token_budget: int, vocab_size: int
) -> list[tuple[str, list[int], SamplingParams]]:
    """The synthetic requests (id, prompt token ids, sampling), all admitted at once."""
    generator = torch.Generator().manual_seed(0)
    requests = []
    for wave, prompts in enumerate(_waves(max_model_len, token_budget, vocab_size, generator)):
        for index, prompt in enumerate(prompts):
            params = _SAMPLING[(wave + index) % len(_SAMPLING)]
            requests.append((f"warm-up-{wave}-{index}", prompt, params))
    return requests


def _waves(
    max_model_len: int, token_budget: int, vocab_size: int, generator: torch.Generator
) -> Iterator[list[list[int]]]:
    """Groups of synthetic prompts, all admitted at once: every bucketed length, each sampling path, and
    (where it fits) a prompt over the step budget and a repeat of one prompt for a prefix hit."""
    longest = max_model_len - WARM_TOKENS
    if longest < 1:
        return
    lengths = sorted({min(length, longest) for length in PROMPT_LENGTHS})

    def prompt(length: int) -> list[int]:
        return torch.randint(0, vocab_size, (length,), generator=generator).tolist()

    yield [prompt(length) for length in lengths]
    yield [prompt(lengths[-1]) for _ in _SAMPLING]
    if token_budget < longest:
        over_budget = prompt(min(longest, token_budget + 17))
        yield [over_budget, list(over_budget)]
