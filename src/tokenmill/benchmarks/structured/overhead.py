"""The end-to-end cost of structured outputs: the same workload unconstrained, with every request under
the nested schema (per backend), and unconstrained again, in one process; output tokens per second.

Each constrained request is held to ``endless(NESTED)`` (an array of nested objects longer than the run),
so it generates exactly its ``max_tokens``, as the unconstrained ones do with ``ignore_eos``: equal work.
The two unconstrained runs bracket the others and show the run-to-run noise; they take today's path
exactly (no row has a grammar, so no structured-output code runs).

Before any number, :func:`check_structured` serves a few prompts under ``NESTED`` greedily with the
measured config and on the plain path (float32, one request at a time): their tokens must be equal (the
masks reach the fast path: graphs, overlap, fused kernels) and every output the grammar ended must
validate with the ``jsonschema`` library.
"""

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.benchmarks.correctness import PLAIN_PATH, float32_copy
from tokenmill.benchmarks.measure import RunResult, measure_engine
from tokenmill.benchmarks.structured.schemas import NESTED, endless
from tokenmill.benchmarks.workload import Workload
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.params import StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer

CHECK_TOKENS = 512  # enough for random weights to finish the nested schema (its strings are bounded)


@dataclass
class StructuredCheck:
    backend: str
    num_prompts: int = 0
    num_finished: int = 0  # outputs the grammar ended (the others reached max_tokens)
    mismatches: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches and not self.invalid and self.num_finished > 0

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        lines = [
            f"structured correctness ({self.backend}) {verdict}: {self.num_prompts} prompts under the nested "
            f"schema, greedy, measured config vs plain path in float32: "
            f"{'identical tokens' if not self.mismatches else 'TOKENS DIFFER'}; "
            f"{self.num_finished} ended by the grammar, {len(self.invalid)} of them invalid (jsonschema)"
        ]
        return "\n".join(lines + [f"  {line}" for line in (self.mismatches + self.invalid)[:5]])


def check_structured(
    config: EngineConfig,
    loaded: LoadedModel,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    max_tokens: int = CHECK_TOKENS,
) -> StructuredCheck:
    import jsonschema  # a test dependency (pip install 'tokenmill[dev]')

    check = StructuredCheck(config.structured_output_backend, num_prompts=len(prompts))
    longest = max(len(prompt) for prompt in prompts) + max_tokens
    max_model_len = min(-(-longest // 64) * 64, loaded.config.max_position_embeddings)
    config = config.with_options(
        dtype="float32",
        max_model_len=max_model_len,
        max_num_batched_tokens=max(config.scheduler.max_num_batched_tokens or 0, max_model_len),
        warm_start=False,
        num_kv_blocks=len(prompts) * (-(-longest // config.kv.block_size) + 1),
    )
    reference = dataclasses.replace(float32_copy(config, loaded), tokenizer=tokenizer)
    fast = _greedy_nested(LLMEngine(config, loaded=reference), prompts, max_tokens)
    plain = _greedy_nested(
        LLMEngine(config.with_options(**PLAIN_PATH), loaded=reference), prompts, max_tokens
    )
    for index, ((tokens, finished), (plain_tokens, _)) in enumerate(zip(fast, plain, strict=True)):
        if tokens != plain_tokens:
            check.mismatches.append(f"prompt {index}: tokens differ from the plain path's")
        if finished:
            check.num_finished += 1
            text = tokenizer.decode(tokens)
            try:
                jsonschema.validate(json.loads(text), NESTED)
            except (ValueError, jsonschema.ValidationError) as exc:
                check.invalid.append(f"prompt {index}: {text[:80]!r}...: {str(exc)[:80]}")
    return check


def _greedy_nested(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[tuple[list[int], bool]]:
    """Each prompt's tokens under NESTED (no whitespace, so random weights end sooner), and whether its
    grammar ended it."""
    constraint = StructuredOutputsParams(json=NESTED, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, bool] = {}
    for index, prompt in enumerate(prompts):
        engine.add_request(f"nested-{index}", list(prompt), params)
        tokens[f"nested-{index}"] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
            finished[delta.request_id] = delta.finish_reason == "stop"
    # xgrammar ends on an EOS, llguidance before it: the text is what comes before.
    return [
        ([t for t in tokens[rid] if t not in engine.eos_token_ids], finished.get(rid, False))
        for rid in (f"nested-{index}" for index in range(len(prompts)))
    ]


def measure_overhead(
    config: EngineConfig, loaded: LoadedModel, workload: Workload, backends: Sequence[str], show: bool
) -> list[RunResult]:
    """Unconstrained, then constrained under each backend, then unconstrained again."""
    runs = [measure_engine(config, loaded, workload, "unconstrained", show)]
    constrained = dataclasses.replace(
        workload, structured_outputs=StructuredOutputsParams(json=endless(NESTED))
    )
    for backend in backends:
        label = f"all constrained ({backend})"
        run = measure_engine(
            config.with_options(structured_output_backend=backend), loaded, constrained, label, show
        )
        short = [rid for rid, ids in run.output_token_ids.items() if len(ids) != _expected(workload, rid)]
        if short:
            raise RuntimeError(f"{label}: {len(short)} requests ended before max_tokens ({short[:3]})")
        runs.append(run)
    runs.append(measure_engine(config, loaded, workload, "unconstrained again", show))
    return runs


def _expected(workload: Workload, request_id: str) -> int:
    return next(request.output_len for request in workload.requests if request.request_id == request_id)
