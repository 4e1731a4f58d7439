"""Prompt lookup: guess that the output goes on as it did after the last earlier occurrence of its end.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last ``n`` tokens of the prompt
and output so far are looked up among the earlier tokens; at the most recent earlier occurrence of the
longest ``n`` that has one, the tokens that followed it (up to ``k``) are the guess. It costs a few numpy
comparisons per sequence and no model: outputs that copy from their prompt (editing, extraction, code
refactoring) are guessed well, and other outputs simply get no guess.
"""

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.sequence import Sequence as Seq
from tokenmill.speculative.proposer import Proposal, Proposer


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        super().__init__(num_speculative_tokens)
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: Sequence[Seq], max_drafts: Sequence[int]) -> list[Proposal]:
        return [
            Proposal(lookup(seq.token_ids, self.min_n, self.max_n, limit) if limit > 0 else [])
            for seq, limit in zip(seqs, max_drafts, strict=True)
        ]


def lookup(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``token_ids`` of ``min_n`` to ``max_n`` tokens; none where no such suffix occurs earlier."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length-1-n: each has a token after it, and none is the suffix itself
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
