"""Timed runs of one engine: requests one at a time (decode tokens per second after each first token) or
all at once (output tokens per second), with the speculative-decoding counters of the run."""

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import SpecDecodeCounts
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence as Seq
from tokenmill.speculative.proposer import Proposal, Proposer


@dataclass
class TimedRun:
    label: str
    outputs: list[list[int]]
    num_decode_tokens: int  # tokens after each request's first
    decode_s: float  # from each request's first token to its last
    num_decode_steps: int
    elapsed_s: float
    spec: SpecDecodeCounts
    propose_s: float = 0.0  # of decode_s, in the proposer (a draft model's steps)

    @property
    def num_output_tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def decode_tok_s(self) -> float:
        return self.num_decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def step_s(self) -> float:
        """Mean decode step (a round of draft and verification where speculating)."""
        return self.decode_s / self.num_decode_steps if self.num_decode_steps else 0.0


def merged(label: str, runs: Sequence[TimedRun]) -> TimedRun:
    """One run out of several (e.g. one per prompt): outputs concatenated, times and counts added."""
    total = TimedRun(label, [], 0, 0.0, 0, 0.0, SpecDecodeCounts())
    for run in runs:
        total.outputs += run.outputs
        total.num_decode_tokens += run.num_decode_tokens
        total.decode_s += run.decode_s
        total.num_decode_steps += run.num_decode_steps
        total.elapsed_s += run.elapsed_s
        total.spec.add(run.spec)
        total.propose_s += run.propose_s
    return total


class TimedProposer(Proposer):
    """A proposer that adds up the time its ``propose`` calls take."""

    def __init__(self, inner: Proposer) -> None:
        super().__init__(inner.num_speculative_tokens)
        self.inner = inner
        self.seconds = 0.0

    def propose(self, seqs: Sequence[Seq], max_drafts: Sequence[int]) -> list[Proposal]:
        started = time.perf_counter()
        proposals = self.inner.propose(seqs, max_drafts)
        self.seconds += time.perf_counter() - started
        return proposals


def _counts(engine: LLMEngine) -> SpecDecodeCounts:
    return dataclasses.replace(engine.scheduler.stats.spec_decode)


def _minus(after: SpecDecodeCounts, before: SpecDecodeCounts) -> SpecDecodeCounts:
    fields = [f.name for f in dataclasses.fields(SpecDecodeCounts)]
    return SpecDecodeCounts(*(getattr(after, name) - getattr(before, name) for name in fields))


def timed_proposer(engine: LLMEngine) -> TimedProposer | None:
    if engine.proposer is None:
        return None
    if not isinstance(engine.proposer, TimedProposer):
        engine.proposer = TimedProposer(engine.proposer)
    return engine.proposer


def one_at_a_time(
    label: str, engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams
) -> TimedRun:
    """Each prompt alone (batch 1), greedy: decode tokens per second from its first token on."""
    before, proposer = _counts(engine), timed_proposer(engine)
    propose_before = proposer.seconds if proposer else 0.0
    run = TimedRun(label, [], 0, 0.0, 0, 0.0, SpecDecodeCounts())
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{label}-{index}", prompt, params)
        tokens: list[int] = []
        first = None
        while engine.has_unfinished_requests():
            deltas = engine.step()
            if first is not None:
                run.num_decode_steps += 1
            for delta in deltas:
                tokens += delta.new_token_ids
            if first is None and tokens:
                first = time.perf_counter()
                first_count = len(tokens)
        run.outputs.append(tokens)
        if first is not None:
            run.decode_s += time.perf_counter() - first
            run.num_decode_tokens += len(tokens) - first_count
    run.elapsed_s = time.perf_counter() - started
    run.spec = _minus(_counts(engine), before)
    run.propose_s = (proposer.seconds - propose_before) if proposer else 0.0
    return run


def all_at_once(
    label: str, engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams
) -> TimedRun:
    """Every prompt at once (continuous batching): output tokens per second over the whole run."""
    before = _counts(engine)
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{label}-{index}", prompt, params)
        outputs[f"{label}-{index}"] = []
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        steps += 1
    elapsed = time.perf_counter() - started
    tokens = list(outputs.values())
    return TimedRun(
        label, tokens, sum(map(len, tokens)), elapsed, steps, elapsed, _minus(_counts(engine), before)
    )
