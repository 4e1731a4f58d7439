"""Which steps verify guesses, and when the next decode step may be started ahead of reading this one.

A plain decode step can be started before the host reads the step it follows (overlapped decode: the
GPU runs it while the host turns tokens into text and schedules); a verification step cannot, since its
shape comes from guesses made on the tokens it follows. So below ``speculative_disable_by_batch_size``
a decode step is started ahead only after a step for which nothing was guessed (text that does not copy
most likely still does not). When guesses do come while such a started step is in flight for exactly
the running sequences, they wait one step: the started step runs (its tokens are the model's anyway), and
the proposer guesses again on them. Verifying at once instead would drop the started step, whose work
the GPU has done or is doing, and wait behind it.
"""

from collections.abc import Collection, Sequence

from tokenmill.sequence import Sequence as Seq
from tokenmill.speculative.proposer import Proposer, propose_drafts


class GuessingRounds:
    def __init__(self, max_model_len: int, disable_by_batch_size: int | None) -> None:
        self.max_model_len = max_model_len
        self.disable_by_batch_size = disable_by_batch_size
        self.num_guessing = 0  # sequences whose guesses the step running now verifies
        self.deferred = False  # guesses came for the step running now, and wait for its started step

    def propose(self, proposer: Proposer, running: Sequence[Seq], started: Collection[Seq] | None) -> None:
        """Give the running sequences their guesses for the next step; defer them all (drop them; they are
        made again next step) when ``started``, the sequences of a decode step started ahead, are exactly
        the running ones."""
        cutoff = self.disable_by_batch_size
        self.num_guessing = propose_drafts(proposer, running, self.max_model_len, cutoff)
        self.deferred = bool(self.num_guessing) and started is not None and set(started) == set(running)
        if self.deferred:
            for seq in running:
                seq.draft_token_ids = []
                seq.draft_probs = None
            self.num_guessing = 0

    def allows_start_ahead(self, num_running: int) -> bool:
        """Whether the decode step after the one running now may be started before it is read: nothing
        was guessed for it (nor deferred), or no step speculates at this batch size."""
        if self.num_guessing == 0 and not self.deferred:
            return True
        cutoff = self.disable_by_batch_size
        return cutoff is not None and num_running >= cutoff
