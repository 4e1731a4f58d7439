"""Admission rules: how many KV blocks admitting a sequence must leave free (``SchedulerConfig.admission``).

Admission always needs the newcomer's own tokens to fit; a rule keeps more free so the sequences admitted
together can grow without preempting each other. ``fit`` keeps nothing (most concurrency; growth may
preempt), ``headroom`` keeps what every running sequence and the newcomer need for ``admission_headroom``
of their remaining ``max_tokens``, and ``lookahead`` keeps what the busiest future step needs, counting
the blocks that sequences finishing before it free.
"""

import math
from abc import ABC, abstractmethod
from collections import abc

from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import SchedulerConfig
from tokenmill.sequence import Sequence


class AdmissionRule(ABC):
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def keep_free(self, running: abc.Sequence[Sequence], newcomer: Sequence, newcomer_tokens: int) -> int:
        """Blocks to leave free when admitting ``newcomer`` with ``newcomer_tokens`` tokens. None while
        nothing runs, so the head of the queue is always admitted once its own tokens fit."""
        return self._keep_free(running, newcomer, newcomer_tokens) if running else 0

    @abstractmethod
    def _keep_free(
        self, running: abc.Sequence[Sequence], newcomer: Sequence, newcomer_tokens: int
    ) -> int: ...


class FitAdmission(AdmissionRule):
    def _keep_free(self, running: abc.Sequence[Sequence], newcomer: Sequence, newcomer_tokens: int) -> int:
        return 0


class HeadroomAdmission(AdmissionRule):
    def __init__(self, kv: KVCacheManager, ratio: float) -> None:
        super().__init__(kv)
        self.ratio = ratio

    def _growth(self, seq: Sequence) -> int:
        return math.ceil(self.ratio * max(0, seq.max_tokens - seq.num_output_tokens))

    def _keep_free(self, running: abc.Sequence[Sequence], newcomer: Sequence, newcomer_tokens: int) -> int:
        kv = self.kv
        held = sum(kv.blocks_needed(seq, seq.num_tokens + self._growth(seq)) for seq in running)
        grown = kv.blocks_for_tokens(newcomer_tokens + self._growth(newcomer))
        return held + grown - kv.blocks_for_tokens(newcomer_tokens)


class LookaheadAdmission(AdmissionRule):
    def _keep_free(self, running: abc.Sequence[Sequence], newcomer: Sequence, newcomer_tokens: int) -> int:
        """How far the busiest future step's blocks exceed today's, with every running sequence and the
        newcomer growing one token a step to its ``max_tokens`` and freeing its blocks when done."""
        # (tokens held now, steps until it finishes): t steps from now a sequence holds tokens + t slots.
        growth = [(seq.num_tokens, seq.max_tokens - seq.num_output_tokens) for seq in running]
        growth.append((newcomer_tokens, newcomer.max_tokens - newcomer.num_output_tokens))
        held_now = sum(self.kv.blocks_for_tokens(tokens) for tokens, _ in growth)
        return peak_blocks(growth, self.kv.block_size) - held_now


def create_admission_rule(config: SchedulerConfig, kv: KVCacheManager) -> AdmissionRule:
    if config.admission == "lookahead":
        return LookaheadAdmission(kv)
    if config.admission == "headroom" and config.admission_headroom:
        return HeadroomAdmission(kv, config.admission_headroom)
    return FitAdmission(kv)


def peak_blocks(growth: abc.Sequence[tuple[int, int]], block_size: int) -> int:
    """The most blocks held at any future step by sequences that each hold ``tokens + t`` slots ``t`` steps
    from now and finish after ``steps`` steps, for ``(tokens, steps)`` in ``growth`` (``steps`` >= 1).
    Between two finishes the total only grows, so the peak is at a step just before some sequence ends.

    In O(n log n + n * block_size), not O(n^2), as it runs at every admission: with ``tokens + block_size
    - 1 = q * block_size + r`` and ``t = k * block_size + m``, a sequence holds ``q + k + (r + m >=
    block_size)`` blocks at step ``t``, so the total over the sequences still running is their sum of
    ``q``, ``k`` per sequence, and the count of their ``r`` of at least ``block_size - m``."""
    # (q, r, steps) per sequence, by finish step; the counts cover the sequences still running.
    by_finish = sorted(
        ((*divmod(tokens + block_size - 1, block_size), steps) for tokens, steps in growth),
        key=lambda entry: entry[2],
    )
    quotient_sum = sum(quotient for quotient, _, _ in by_finish)
    residue_counts = [0] * block_size
    for _, residue, _ in by_finish:
        residue_counts[residue] += 1
    running, peak = len(by_finish), 0
    for quotient, residue, steps in by_finish:  # the step before each finish; then that sequence is done
        k, m = divmod(steps - 1, block_size)
        peak = max(peak, quotient_sum + running * k + sum(residue_counts[block_size - m :]))
        quotient_sum -= quotient
        residue_counts[residue] -= 1
        running -= 1
    return peak
