"""The proposer interface, and the engine's call into it before each step.

A proposer guesses up to ``k`` next tokens for each decoding sequence (``propose``); it may keep state
per sequence (a draft model's KV cache), and drops that of sequences it is no longer asked about. A
sequence proposes only when it is decoding (its one uncomputed token is the last sampled one), may still
emit two tokens, has no grammar (structured outputs are not speculated: their drafts would need the
grammar's approval token by token, so they run plain decode steps), and has not opted out
(``SamplingParams.speculative=False``).
"""

from abc import ABC, abstractmethod
from collections import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.sequence import Sequence as Seq

if TYPE_CHECKING:
    import torch


@dataclass
class Proposal:
    token_ids: list[int]
    probs: "torch.Tensor | None" = None  # [len(token_ids), V] draft distributions; None: one-hot


class Proposer(ABC):
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    @abstractmethod
    def propose(self, seqs: Sequence[Seq], max_drafts: Sequence[int]) -> list[Proposal]:
        """For each sequence, at most ``max_drafts[i]`` guessed tokens to follow its tokens (maybe none)."""


def wants_drafts(seq: Seq) -> bool:
    return (
        seq.num_uncomputed_tokens == 1
        and seq.num_output_tokens > 0
        and seq.grammar is None
        and seq.params.speculative
        and seq.max_tokens - seq.num_output_tokens > 1
    )


def propose_drafts(
    proposer: Proposer, running: abc.Sequence[Seq], max_model_len: int, max_batch: int | None = None
) -> int:
    """Give each running sequence that wants them the proposer's guesses for the next step; none while
    ``max_batch`` or more sequences run. Returns how many sequences got at least one guess."""
    if max_batch is not None and len(running) >= max_batch:
        return 0
    seqs = [seq for seq in running if wants_drafts(seq)]
    if not seqs:
        return 0
    k = proposer.num_speculative_tokens
    limits = [
        min(k, seq.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens - 1) for seq in seqs
    ]
    guessing = 0
    for seq, proposal in zip(seqs, proposer.propose(seqs, limits), strict=True):
        seq.draft_token_ids = proposal.token_ids
        seq.draft_probs = proposal.probs
        guessing += bool(proposal.token_ids)
    return guessing
