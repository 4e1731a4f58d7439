"""What the engine returns: per-step deltas for streaming, and whole results for the offline API.

The engine's deltas carry ``RowLogprobs`` (compact, one per position); the offline results carry vLLM's
shape, one ``{token id: Logprob}`` dict per position, so ``output.logprobs[i][token_id].logprob`` works.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias


class RowLogprobs(NamedTuple):
    """One sampled (or prompt) position's logprob, rank and top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 + number of tokens strictly more likely
    top: list[tuple[int, float]]  # (id, logprob), most likely first


@dataclass
class SpecDecodeCounts:
    """Speculative decoding of one sequence (or, summed, of the engine): ``num_steps`` verification steps
    with at least one draft token, ``num_proposed`` draft tokens run, ``num_accepted`` of them accepted,
    ``num_emitted`` tokens those steps produced (accepted ones plus one each, fewer where a stop cut
    them off)."""

    num_steps: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_emitted: int = 0

    def snapshot(self) -> "SpecDecodeCounts":
        """A copy (``dataclasses.replace`` costs ~4x more: once per token of every sequence, it showed)."""
        return SpecDecodeCounts(self.num_steps, self.num_proposed, self.num_accepted, self.num_emitted)

    def add(self, other: "SpecDecodeCounts") -> None:
        self.num_steps += other.num_steps
        self.num_proposed += other.num_proposed
        self.num_accepted += other.num_accepted
        self.num_emitted += other.num_emitted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step (accepted drafts plus the model's own token)."""
        return self.num_emitted / self.num_steps if self.num_steps else 0.0

    def as_metrics(self) -> dict[str, float]:
        return {
            "spec_decode_num_steps": self.num_steps,
            "spec_decode_num_draft_tokens": self.num_proposed,
            "spec_decode_num_accepted_tokens": self.num_accepted,
            "spec_decode_num_emitted_tokens": self.num_emitted,
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_accepted_length": self.mean_accepted_length,
        }


@dataclass
class Logprob:
    """One token's log probability at one position, as vLLM names it."""

    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str | None = None


# One position: the chosen token and the top alternatives, by token id (the chosen one first).
PositionLogprobs: TypeAlias = dict[int, Logprob]
TokenText: TypeAlias = Callable[[int], str]


def position_logprobs(row: RowLogprobs, token_text: TokenText | None = None) -> PositionLogprobs:
    """``row`` in vLLM's shape: the chosen token with its rank, then the top ones ranked 1, 2, ..."""

    def entry(token_id: int, logprob: float, rank: int) -> Logprob:
        return Logprob(logprob, rank, None if token_text is None else token_text(token_id))

    found = {row.token_id: entry(row.token_id, row.logprob, row.rank)}
    for rank, (token_id, logprob) in enumerate(row.top, start=1):
        found.setdefault(token_id, entry(token_id, logprob, rank))
    return found


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None
    # With speculative decoding on: this sequence's verification steps, draft tokens and acceptance.
    spec_decode: SpecDecodeCounts | None = None

    @property
    def sampled_logprobs(self) -> list[Logprob] | None:
        """The sampled tokens' own entries, one per output token (a shortcut through ``logprobs``)."""
        if self.logprobs is None:
            return None
        return [position[token] for position, token in zip(self.logprobs, self.token_ids, strict=False)]

    @property
    def cumulative_logprob(self) -> float | None:
        sampled = self.sampled_logprobs
        return None if sampled is None else sum(entry.logprob for entry in sampled)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # the first position has none
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)

    def apply(self, delta: "RequestDelta", token_text: TokenText | None = None) -> None:
        """Fold one step's delta into the accumulated output; ``token_text`` fills ``decoded_token``."""
        output = self.outputs[delta.index]
        output.text += delta.new_text
        output.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            new = [position_logprobs(row, token_text) for row in delta.new_logprobs]
            output.logprobs = (output.logprobs or []) + new
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = [
                None if row is None else position_logprobs(row, token_text) for row in delta.prompt_logprobs
            ]
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        output.finish_reason = delta.finish_reason
        output.stop_reason = delta.stop_reason
        if delta.spec_decode is not None:
            output.spec_decode = delta.spec_decode

    @property
    def metrics(self) -> dict[str, float]:
        """Per-request figures: with speculative decoding, its sequences' draft tokens proposed, accepted
        and emitted, verification steps, acceptance rate and mean tokens per verification step."""
        total = SpecDecodeCounts()
        for output in self.outputs:
            if output.spec_decode is not None:
                total.add(output.spec_decode)
        return total.as_metrics() if any(o.spec_decode is not None for o in self.outputs) else {}


@dataclass
class RequestDelta:
    """What one step added to one sequence (``index`` of its request's ``n``): stream this."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[RowLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[RowLogprobs | None] | None = None  # once, with the first delta
    spec_decode: SpecDecodeCounts | None = None  # the sequence's counts so far, when speculating

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
