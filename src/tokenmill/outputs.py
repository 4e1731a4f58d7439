"""What the engine returns: per-step deltas for streaming, and whole results for the offline API."""

from dataclasses import dataclass, field
from typing import NamedTuple


class RowLogprobs(NamedTuple):
    """One sampled (or prompt) position's logprob, rank and top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 + number of tokens strictly more likely
    top: list[tuple[int, float]]  # (id, logprob), most likely first


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[RowLogprobs] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(entry.logprob for entry in self.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[RowLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)

    def apply(self, delta: "RequestDelta") -> None:
        """Fold one step's delta into the accumulated output."""
        output = self.outputs[delta.index]
        output.text += delta.new_text
        output.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            output.logprobs = (output.logprobs or []) + delta.new_logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        output.finish_reason = delta.finish_reason
        output.stop_reason = delta.stop_reason


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
