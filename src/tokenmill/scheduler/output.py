"""What deciding hands executing, and what comes back: the contract between scheduler and runner."""

from dataclasses import dataclass, field

from tokenmill.outputs import RowLogprobs, SpecDecodeCounts
from tokenmill.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start:end`` of ``seq`` run this step; the last ``num_draft_tokens`` of them are a
    proposer's guesses (speculative decoding), verified by the step."""

    seq: Sequence
    start: int
    end: int
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples_next_token(self) -> bool:
        """After this chunk every token is computed, so the step samples the next one."""
        return self.end == self.seq.num_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Positions whose logits the step needs: the last one, and one per draft token before it."""
        return 1 + self.num_draft_tokens if self.samples_next_token else 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class StepResult:
    """What one executed step produced: the tokens (and their logprobs, if asked for) of each sampled
    sequence, one or (verifying draft tokens) more, and the logprobs of the prompt positions its chunks
    computed, for sequences that asked for them."""

    sampled: dict[Sequence, list[tuple[int, RowLogprobs | None]]] = field(default_factory=dict)
    prompt_logprobs: dict[Sequence, list[RowLogprobs]] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    """Counters since the scheduler started, read by the server's metrics and the offline API."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at first admission
    prefix_cache_hits: int = 0  # of those, tokens whose KV was found there
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
