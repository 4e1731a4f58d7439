"""The engine's part in structured outputs after a step: moving the matchers past the sampled tokens,
ending the sequences whose grammar is complete, and starting the next masks' fill in the background."""

import logging
from collections.abc import Iterable

from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.sequence import FinishReason, Sequence
from tokenmill.structured.backend import GrammarMatcher
from tokenmill.structured.manager import StructuredOutputs

logger = logging.getLogger(__name__)


def advance_grammars(
    structured: StructuredOutputs, scheduler: Scheduler, rows: list[tuple[Sequence, int]]
) -> None:
    """Move each ``(sequence, token)``'s matcher past its token (distinct sequences, one batch) and end the
    sequences whose grammar is complete. A token the grammar refuses cannot come from its mask, except
    where nothing was left to sample (every allowed token banned, e.g. EOS by ``min_tokens``): that
    sequence ends there."""
    accepted = structured.advance([(_matcher(seq), token) for seq, token in rows])
    for (seq, token), ok in zip(rows, accepted, strict=True):
        if not ok:
            logger.warning("%s: token %d is outside its grammar; ending it", seq.seq_id, token)
        if (not ok or _matcher(seq).is_terminated()) and not seq.is_finished:
            scheduler.finish(seq, FinishReason.STOP)


def fill_masks_ahead(structured: StructuredOutputs, running: Iterable[Sequence]) -> None:
    """Start filling the next masks of the running sequences that have a grammar, in the background."""
    structured.fill_ahead([seq.grammar for seq in running if seq.grammar is not None and not seq.is_finished])


def _matcher(seq: Sequence) -> GrammarMatcher:
    assert seq.grammar is not None
    return seq.grammar
