"""The grammar-backend interface: compile a constraint once, match one sequence's tokens, fill bitmasks.

A backend is built for one tokenizer and one vocabulary size (the model's, the width of its logits). It
compiles a :class:`~tokenmill.structured.params.GrammarSpec` into a :class:`CompiledGrammar` (shared by
every sequence that asks for the same constraint), which hands out one :class:`GrammarMatcher` per
sequence. Each step, :meth:`GrammarBackend.fill_bitmasks` writes the next-token masks of a batch's
constrained rows into a ``[rows, ceil(vocab / 32)]`` int32 tensor on the CPU: bit ``t % 32`` of word
``t // 32`` is set where token ``t`` may come next. EOS is allowed only where the grammar accepts.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.errors import TokenmillError
from tokenmill.structured.params import GrammarSpec


class StructuredOutputError(TokenmillError, ValueError):
    """A request's structured output cannot be served as asked; the message says why."""


class GrammarCompileError(StructuredOutputError):
    """A schema, regex or grammar that does not compile; the message names its field."""

    def __init__(self, spec: GrammarSpec, reason: str) -> None:
        super().__init__(f"{spec.field} is not a valid {_WHAT[spec.kind]}: {reason.strip()}")
        self.field = spec.field


_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "choice", "grammar": "grammar"}


def bitmask_width(vocab_size: int) -> int:
    """Int32 words per row of a token bitmask."""
    return -(-vocab_size // 32)


@dataclass(frozen=True)
class Vocabulary:
    """What a backend is built for: the tokenizer (a Hugging Face fast tokenizer), the model's vocabulary
    size (ids at or past the tokenizer's are never allowed) and the ids that end a sequence."""

    hf_tokenizer: object
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class GrammarMatcher(ABC):
    """One sequence's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and the matcher unusable) if the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing but ending: the sequence is done."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's rejected drafts)."""


class CompiledGrammar(ABC):
    """A constraint compiled for a vocabulary; thread-safe and shared by the sequences that use it."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start."""


class GrammarBackend(ABC):
    """Compiles constraints and fills batches of bitmasks; one per engine, built for its vocabulary."""

    name: str

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocab_size = vocabulary.vocab_size

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec``; a bad schema, regex or grammar raises :class:`GrammarCompileError`."""

    @abstractmethod
    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Write each ``(matcher, row)``'s next-token mask into ``bitmask[row]`` (a contiguous CPU int32
        tensor ``[num_rows, bitmask_width(vocab_size)]``); other rows are left as they are."""

    @property
    def width(self) -> int:
        return bitmask_width(self.vocab_size)
