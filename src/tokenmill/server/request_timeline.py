"""When each phase of one engine request happened, for the per-request metric families.

The engine reports no scheduling events, so the engine side infers them around each step: a request
was scheduled at the start of the first step after which any of its sequences has computed tokens, and
a step computed as many tokens as its sequences' computed counts grew by (prefix-cache hits not counted).
What it observes is gathered as plain data (``StepMetrics``) that ``ServerMetrics.record`` applies: at
once with the engine in a thread, after a trip down the pipe with the engine in its own process.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.sequence import Sequence


@dataclass(frozen=True)
class FinishedRequest:
    """One finished engine request (a prompt and its ``n`` sequences), as the metrics see it."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int  # over its n sequences
    max_num_generation_tokens: int  # of its longest sequence
    n: int
    max_tokens: int
    queue_s: float  # arrival to first scheduled
    prefill_s: float  # first scheduled to first token
    decode_s: float  # first token to the last
    inference_s: float  # first scheduled to the last token
    e2e_s: float  # arrival to the last token


@dataclass
class StepMetrics:
    """The metric observations of one pass of the engine loop (adds and a step)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    iteration_tokens: list[int] = field(default_factory=list)
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


@dataclass
class RequestTimeline:
    arrival_time: float
    seqs: list[Sequence]
    scheduled_time: float | None = None
    first_token_time: float | None = None
    num_output_tokens: dict[int, int] = field(default_factory=dict)  # per sequence index

    def observe_step(self, step_start: float) -> None:
        if self.scheduled_time is None and any(seq.num_computed_tokens > 0 for seq in self.seqs):
            self.scheduled_time = step_start

    def observe_tokens(self, index: int, num_new_tokens: int, now: float) -> None:
        if num_new_tokens and self.first_token_time is None:
            self.first_token_time = now
        self.num_output_tokens[index] = self.num_output_tokens.get(index, 0) + num_new_tokens

    def finished(self, finish_reason: str, now: float) -> FinishedRequest:
        scheduled = self.scheduled_time if self.scheduled_time is not None else self.arrival_time
        first_token = self.first_token_time if self.first_token_time is not None else now
        counts = list(self.num_output_tokens.values()) or [0]
        return FinishedRequest(
            finish_reason=finish_reason,
            num_prompt_tokens=self.seqs[0].num_prompt_tokens if self.seqs else 0,
            num_generation_tokens=sum(counts),
            max_num_generation_tokens=max(counts),
            n=len(self.seqs),
            max_tokens=self.seqs[0].max_tokens if self.seqs else 0,
            queue_s=scheduled - self.arrival_time,
            prefill_s=first_token - scheduled,
            decode_s=now - first_token,
            inference_s=now - scheduled,
            e2e_s=now - self.arrival_time,
        )


class StepTokenCounter:
    """The tokens one engine step computed: how far its sequences' computed counts moved, less the ones
    the prefix cache supplied."""

    def __init__(self, seqs: Iterable[Sequence]) -> None:
        self._before = [(seq, _computed_here(seq)) for seq in seqs]

    def count(self) -> int:
        # A preempted sequence's count falls back to 0: it computed nothing new.
        return sum(max(0, _computed_here(seq) - before) for seq, before in self._before)


def _computed_here(seq: Sequence) -> int:
    return max(0, seq.num_computed_tokens - seq.num_cached_tokens)
