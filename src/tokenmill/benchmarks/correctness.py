"""The check every benchmark runs before it reports a number: the measured config against the plain path.

The engine config being measured (batched, with Triton attention, fused kernels, CUDA graphs, ...) serves
a few prompts together; the plain path (every fast-path toggle off: PyTorch attention and layers, eager
steps, one request at a time) serves them too, on the same weights, in float32, where rounding does not
flip greedy near-ties. Their greedy tokens must be equal and the log-probabilities of those tokens close.
(In bfloat16 two correct implementations disagree on near-ties of random weights, so a bf16 comparison
could not tell a bug from rounding.)
"""

import dataclasses
import gc
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.config import PLAIN_PATH as NO_OPTIMIZATIONS
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel, load_model
from tokenmill.sampling_params import SamplingParams

PLAIN_PATH = {"batching": "sequential", **NO_OPTIMIZATIONS}  # one request at a time
LOGPROB_TOLERANCE = 1e-3  # float32; observed differences are around 1e-5


@dataclass
class FastPathCheck:
    toggles: dict[str, object]  # the fast-path settings checked (those that differ from the plain path)
    num_prompts: int = 0
    num_tokens: int = 0
    token_mismatches: list[str] = field(default_factory=list)
    max_logprob_diff: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.token_mismatches and self.max_logprob_diff <= LOGPROB_TOLERANCE

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        toggles = ", ".join(
            f"{name}={'auto' if value is None else value}" for name, value in self.toggles.items()
        )
        lines = [
            f"correctness {verdict}: measured config ({toggles or 'plain'}) vs the plain path, float32, "
            f"{self.num_prompts} prompts, {self.num_tokens} greedy tokens; max |logprob diff| "
            f"{self.max_logprob_diff:.2e} (tolerance {LOGPROB_TOLERANCE:g})"
        ]
        lines += [f"  {mismatch}" for mismatch in self.token_mismatches[:5]]
        return "\n".join(lines)


def fast_path_toggles(config: EngineConfig) -> dict[str, object]:
    return {name: config.option(name) for name, plain in PLAIN_PATH.items() if config.option(name) != plain}


def check_fast_path(
    config: EngineConfig, loaded: LoadedModel, prompts: Sequence[Sequence[int]], max_tokens: int = 32
) -> FastPathCheck:
    """Serve ``prompts`` greedily with ``config`` (all at once) and on the plain path (one at a time), in
    float32, and compare."""
    reference = float32_copy(config, loaded)
    blocks = sum(-(-(len(prompt) + max_tokens) // config.kv.block_size) for prompt in prompts)
    config = config.with_options(dtype="float32", num_kv_blocks=blocks + len(prompts), warm_start=False)
    fast_engine = LLMEngine(config, loaded=reference)
    check = FastPathCheck(fast_path_toggles(fast_engine.config))  # as resolved for this hardware
    fast = _greedy(fast_engine, prompts, max_tokens)
    del fast_engine
    plain = _greedy(LLMEngine(config.with_options(**PLAIN_PATH), loaded=reference), prompts, max_tokens)
    for index, ((fast_ids, fast_lps), (plain_ids, plain_lps)) in enumerate(zip(fast, plain, strict=True)):
        check.num_prompts += 1
        check.num_tokens += len(plain_ids)
        if fast_ids != plain_ids:
            pairs = enumerate(zip(fast_ids, plain_ids, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(fast_ids), len(plain_ids)))
            check.token_mismatches.append(f"prompt {index}: tokens differ from position {first}")
        diffs = [abs(a - b) for a, b in zip(fast_lps, plain_lps, strict=False)]
        check.max_logprob_diff = max([check.max_logprob_diff, *diffs])
    del reference
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return check


def float32_copy(config: EngineConfig, loaded: LoadedModel) -> LoadedModel:
    """``loaded`` in float32: the same weights reloaded, with the tokenizer and EOS ids it was given (a
    dummy model's may be borrowed from another model)."""
    if loaded.dtype == torch.float32:
        return loaded
    copy = load_model(
        config.model,
        device=loaded.device,
        dtype="float32",
        load_format=config.load_format,
        max_model_len=config.max_model_len,
        seed=config.seed,
        quantization=config.quantization,  # the same quantized weights, on their PyTorch reference path
    )
    return dataclasses.replace(copy, tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids)


def _greedy(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """All prompts at once (so batched and graph paths run); each one's tokens and their logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    results: dict[str, tuple[list[int], list[float]]] = {}
    for index, prompt in enumerate(prompts):
        engine.add_request(f"check-{index}", list(prompt), params)
        results[f"check-{index}"] = ([], [])
    while engine.has_unfinished_requests():
        for delta in engine.step():
            ids, logprobs = results[delta.request_id]
            ids.extend(delta.new_token_ids)
            logprobs.extend(entry.logprob for entry in delta.new_logprobs or [])
    return [results[f"check-{index}"] for index in range(len(prompts))]
