"""A sequence's state as it moves through the engine: tokens, how many are computed, and why it ended.

A request asks for ``n`` sequences (``SamplingParams.n``); each is a :class:`Sequence` of its own that the
scheduler, the KV cache and the runner handle alone, and the engine gathers their outputs by request id.
"""

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.bad_words import BadWordIds, completing_tokens
from tokenmill.outputs import RowLogprobs, SpecDecodeCounts
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.backend import GrammarMatcher

if TYPE_CHECKING:
    import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """One sequence to generate. ``token_ids`` grows by one per sampled token; the engine computes
    (fills the KV cache for) ``token_ids[:num_computed_tokens]``, and every step schedules the rest."""

    seq_id: str  # the request id, with the sequence's index appended when n > 1
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context limit
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # under the "priority" scheduling policy, lower values are served first
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    request_id: str = ""  # the user's request this sequence belongs to (any string, "" too)
    index: int = 0  # which of the n sequences this is
    prompt_logprobs: list[RowLogprobs] = field(default_factory=list)  # filled as the prompt is computed
    grammar: GrammarMatcher | None = None  # with structured outputs: where its output is in its grammar
    bad_words: BadWordIds = ()  # the token sequences of ``params.bad_words`` (bad_words.py)
    cache_salt: str | None = None  # prefix-cache blocks are shared only with sequences of the same salt
    # Speculative decoding: the proposer's guesses of the next tokens (and, from a draft model, the
    # ``[k, V]`` distributions they were drawn from; None: one-hot), taken by the next schedule(), which
    # appends the ones that fit to ``token_ids`` as provisional tokens until the step has verified them.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: "torch.Tensor | None" = None
    num_draft_tokens: int = 0  # provisional tokens at the end of ``token_ids``
    spec: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)  # its speculative steps

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def __repr__(self) -> str:  # the KV cache's bookkeeping names its sequences (its keys) this way
        return f"Sequence({self.seq_id!r})"

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt positions whose next-token logprob is known."""
        return len(self.prompt_logprobs)

    @cached_property
    def prompt_id_array(self) -> np.ndarray:
        """The prompt's ids as an int64 array, made once: a sampling step with repetition penalties reads
        every prompt id of its rows, and converting the list each step cost milliseconds a step."""
        return np.asarray(self.prompt_token_ids, dtype=np.int64)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids) - self.num_draft_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens, without provisional (draft) ones."""
        return self.token_ids[len(self.prompt_token_ids) : len(self.token_ids) - self.num_draft_tokens]

    @property
    def draft_tokens(self) -> list[int]:
        """The provisional tokens this step verifies."""
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    def attach_drafts(self, count: int) -> None:
        """Append the first ``count`` proposed tokens as provisional tokens; drop the proposal."""
        self.token_ids.extend(self.draft_token_ids[:count])
        self.num_draft_tokens = count
        self.draft_token_ids = []
        if count == 0:
            self.draft_probs = None

    def drop_drafts(self) -> None:
        """Remove the provisional tokens (verified, or never run)."""
        if self.num_draft_tokens:
            del self.token_ids[-self.num_draft_tokens :]
        self.num_draft_tokens = 0
        self.draft_probs = None

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token: int) -> None:
        """The token sampled after the last one."""
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def banned_token_ids(self, output_ids: list[int] | None = None) -> list[int]:
        """Tokens the next one may not be: EOS and stop tokens until ``min_tokens`` are out, and the tokens
        that would complete a bad word. ``output_ids``: the output before a later position than now (a
        draft token's row); default, the output so far."""
        if output_ids is None:
            output_ids = self.output_token_ids
        banned = completing_tokens(self.bad_words, output_ids) if self.bad_words else []
        if len(output_ids) >= self.params.min_tokens:
            return banned
        eos = [] if self.params.ignore_eos else sorted(self.eos_token_ids)
        return eos + list(self.params.stop_token_ids) + banned
