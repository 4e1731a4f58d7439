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
# kv_cache_dtype fp8: the two paths compute K/V a float32 rounding apart, and where one lands on the other
# side of an e4m3 rounding boundary that element moves by one e4m3 step (6-12% of it); the logprobs
# then differ by more, and a near-tie may flip. Checked instead: logprobs up to and at the first differing
# token within this, and that token a near-tie of the plain path (its two best within this of each other).
LOSSY_KV_TOLERANCE = 0.1


@dataclass
class FastPathCheck:
    toggles: dict[str, object]  # the fast-path settings checked (those that differ from the plain path)
    num_prompts: int = 0
    num_tokens: int = 0
    token_mismatches: list[str] = field(default_factory=list)
    max_logprob_diff: float = 0.0
    tolerance: float = LOGPROB_TOLERANCE
    near_ties: list[str] = field(default_factory=list)  # divergences allowed (lossy KV pool only)

    @property
    def passed(self) -> bool:
        return not self.token_mismatches and self.max_logprob_diff <= self.tolerance

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        toggles = ", ".join(
            f"{name}={'auto' if value is None else value}" for name, value in self.toggles.items()
        )
        lines = [
            f"correctness {verdict}: measured config ({toggles or 'plain'}) vs the plain path, float32, "
            f"{self.num_prompts} prompts, {self.num_tokens} greedy tokens; max |logprob diff| "
            f"{self.max_logprob_diff:.2e} (tolerance {self.tolerance:g})"
        ]
        if self.tolerance != LOGPROB_TOLERANCE:
            lines[0] += (
                f"; float8 KV pool on both paths: logprobs compared up to and at the first differing token, "
                f"which must be a near-tie of the plain path ({len(self.near_ties)} were)"
            )
        lines += [f"  {mismatch}" for mismatch in (self.token_mismatches + self.near_ties)[:5]]
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
    lossy = config.kv.kv_cache_dtype != "auto"
    if lossy:
        check.tolerance = LOSSY_KV_TOLERANCE
    fast = _greedy(fast_engine, prompts, max_tokens)
    del fast_engine
    plain = _greedy(LLMEngine(config.with_options(**PLAIN_PATH), loaded=reference), prompts, max_tokens)
    for index, (fast_run, plain_run) in enumerate(zip(fast, plain, strict=True)):
        check.num_prompts += 1
        check.num_tokens += len(plain_run.token_ids)
        _compare(check, index, fast_run, plain_run, lossy)
    del reference
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return check


def float32_copy(config: EngineConfig, loaded: LoadedModel) -> LoadedModel:
    """``loaded`` in float32 for ``config.max_model_len`` positions: the same weights reloaded, with the
    tokenizer and EOS ids it was given (a dummy model's may be borrowed from another model)."""
    if loaded.dtype == torch.float32 and loaded.position_limit() >= (config.max_model_len or 0):
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


@dataclass
class _GreedyRun:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    runner_up_gaps: list[float] = field(default_factory=list)  # best logprob minus the second best


def _compare(check: FastPathCheck, index: int, fast: _GreedyRun, plain: _GreedyRun, lossy: bool) -> None:
    """Tokens and logprobs of one prompt; with a ``lossy`` KV pool, only up to the first differing token,
    which must be a near-tie of the plain path."""
    pairs = enumerate(zip(fast.token_ids, plain.token_ids, strict=False))
    first = next((i for i, (a, b) in pairs if a != b), None)
    if first is None and len(fast.token_ids) != len(plain.token_ids):
        first = min(len(fast.token_ids), len(plain.token_ids))
    # At the first differing token both paths' best logprobs are still compared: a near-tie keeps them
    # close, a misread pool does not.
    end = len(plain.logprobs) if first is None or not lossy else first + 1
    diffs = [abs(a - b) for a, b in zip(fast.logprobs[:end], plain.logprobs[:end], strict=False)]
    check.max_logprob_diff = max([check.max_logprob_diff, *diffs])
    if first is None:
        return
    gap = plain.runner_up_gaps[first] if first < len(plain.runner_up_gaps) else float("inf")
    if lossy and gap <= LOSSY_KV_TOLERANCE:
        check.near_ties.append(f"prompt {index}: tokens differ from position {first}, a near-tie ({gap:.3f})")
    else:
        check.token_mismatches.append(f"prompt {index}: tokens differ from position {first}")


def _greedy(engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[_GreedyRun]:
    """All prompts at once (so batched and graph paths run); each one's tokens, their logprobs and the
    gap to the runner-up."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    results: dict[str, _GreedyRun] = {}
    for index, prompt in enumerate(prompts):
        engine.add_request(f"check-{index}", list(prompt), params)
        results[f"check-{index}"] = _GreedyRun()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            run = results[delta.request_id]
            run.token_ids.extend(delta.new_token_ids)
            for entry in delta.new_logprobs or []:
                run.logprobs.append(entry.logprob)
                best = [logprob for _, logprob in entry.top]
                run.runner_up_gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return [results[f"check-{index}"] for index in range(len(prompts))]
