"""Deciding which tokens run in the next forward pass.

One rule covers every case: each request has ``token_ids`` and ``num_computed_tokens``, and a step
gives each scheduled request its uncomputed tokens (a whole prompt, or the one token sampled last step)
under a token budget. With ``chunked_prefill`` a prompt may take just what is left of the budget (or
``prefill_chunk_size``) and continue next step, so long prompts run alongside decodes instead of
stalling them. Running requests go first, oldest first; when the KV pool cannot hold their next tokens
the newest running request is preempted (its blocks freed, its tokens kept, recomputed later).
Waiting requests are then admitted while sequences, tokens and blocks allow. The batching modes differ
only in admission: ``sequential`` runs one request at a time, ``static`` admits a new batch only once the
previous one has wholly finished, ``continuous`` admits at every step.

The ``priority`` policy orders both queues by ``scheduling_key`` (priority, then arrival) instead:
running requests are served best first, the worst one is the preemption victim, the best waiting one is
admitted first, and a waiting request that finds the batch full or the pool short preempts running
requests of a strictly worse priority to take their place.
"""

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tokenmill.cache.radix_cache import PrefixMatch, RadixCache, RadixNode
from tokenmill.config import EngineConfig
from tokenmill.runner.kv_cache import KVCache
from tokenmill.sequence import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start:end`` of ``request`` run this step."""

    request: Request
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every token is computed, so the step samples the next one."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerStats:
    """Counters since the scheduler started, read by the server's metrics and the offline API."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at first admission
    prefix_cache_hits: int = 0  # of those, tokens whose KV was found there


def scheduling_key(request: Request) -> tuple[int, float]:
    """Under the ``priority`` policy: the smaller, the sooner served and the later preempted."""
    return request.priority, request.arrival_time


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCache | None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in serving order: the last one is the preemption victim
        self.by_priority = config.scheduling_policy == "priority"
        self.stats = SchedulerStats()
        self.prefix_cache: RadixCache | None = None
        if config.prefix_caching and kv_cache is not None:
            self.prefix_cache = RadixCache.for_manager(kv_cache.manager)
        self._locked_prefix: dict[Request, RadixNode] = {}  # the cached prefix each running request pins
        self._blocks_in_cache: dict[Request, int] = {}  # how many of its full blocks were inserted

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    def add(self, request: Request) -> None:
        self._queue_waiting(request, preempted=False)

    def _queue_waiting(self, request: Request, preempted: bool) -> None:
        """FCFS: a new request joins the back, a preempted one returns to the front. Priority: by key."""
        if self.by_priority:
            bisect.insort(self.waiting, request, key=scheduling_key)
        elif preempted:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _add_running(self, request: Request) -> None:
        if self.by_priority:
            bisect.insort(self.running, request, key=scheduling_key)
        else:
            self.running.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # In serving order; victims of preemption are taken from the end, so never one scheduled already.
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            budget -= self._schedule_running(request, budget, out)
        if self._may_admit(out):
            self._admit_waiting(out)
        return out

    def _chunk_size(self, num_tokens: int, budget: int) -> int:
        """Of ``num_tokens`` uncomputed tokens, how many run this step: all, or with chunked prefill as many
        as the budget allows; 0 when they do not fit."""
        if self.config.chunked_prefill:
            num_tokens = min(num_tokens, budget, self.config.prefill_chunk_size or num_tokens)
        return num_tokens if num_tokens <= budget else 0

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        num_tokens = self._chunk_size(request.num_uncomputed_tokens, budget)
        if num_tokens == 0:
            return 0
        end = request.num_computed_tokens + num_tokens
        while not self._reserve(request, end):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return 0
        out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, end))
        return num_tokens

    def _may_admit(self, out: SchedulerOutput) -> bool:
        if out.preempted:
            return False  # memory is short: admitting now would only preempt again
        return not (self.config.batching == "static" and self.running)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        while self.waiting:
            request = self.waiting[0]
            match = self._match_prefix(request)
            cached = match.num_tokens if match is not None else 0
            start = request.num_computed_tokens + cached
            budget = self.config.max_num_batched_tokens - out.num_tokens
            num_tokens = self._chunk_size(request.num_tokens - start, budget)
            if num_tokens == 0:
                return
            if len(self.running) >= self.config.max_running or not self._reserve_new(
                request, start + num_tokens, match, self._headroom_blocks(request, start + num_tokens)
            ):
                if self._preempt_for(request, out):
                    continue  # the victim's sequence slot and blocks are free now: try again
                return
            self._record_first_admission(request, cached)
            request.num_computed_tokens = start
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self._add_running(request)
            out.chunks.append(ScheduledChunk(request, start, start + num_tokens))

    def _preempt_for(self, request: Request, out: SchedulerOutput) -> bool:
        """Under the priority policy, preempt the worst running request to make room for ``request`` if
        its priority is strictly worse (a victim scheduled this step loses its chunk); False if none is."""
        if not self.by_priority or not self.running:
            return False
        victim = self.running[-1]
        if victim.priority <= request.priority:
            return False
        out.chunks = [chunk for chunk in out.chunks if chunk.request is not victim]
        self._preempt(victim, out)
        return True

    def _reads_prefix_cache(self, request: Request) -> bool:
        """Whether admission looks ``request`` up: only from scratch (new, or preempted), and not when
        prompt logprobs need every prompt position computed."""
        return not request.num_computed_tokens and request.params.prompt_logprobs is None

    def _match_prefix(self, request: Request) -> PrefixMatch | None:
        """The longest cached prefix of a request starting from scratch."""
        if self.prefix_cache is None or not self._reads_prefix_cache(request):
            return None
        match = self.prefix_cache.match_prefix(request.token_ids)
        return match if match.blocks else None

    def _record_first_admission(self, request: Request, num_cached: int) -> None:
        """What the prefix cache gave the request's first admission. A preempted request's later ones
        find its own earlier blocks, which says nothing about prompt reuse, so they are not counted."""
        if request.num_preemptions:
            return
        request.num_cached_tokens = num_cached
        if self.prefix_cache is not None and self._reads_prefix_cache(request):
            self.stats.prefix_cache_queries += request.num_prompt_tokens
            self.stats.prefix_cache_hits += num_cached

    def _headroom_blocks(self, newcomer: Request, newcomer_tokens: int) -> int:
        """Blocks admitting ``newcomer`` must leave free: those the running requests and the newcomer need to
        generate ``admission_headroom`` of their remaining output. None while nothing runs, so the head of
        the queue is always admitted once its own tokens fit. Under ``admission_lookahead``: the blocks that
        keep every request's growth to its ``max_tokens`` preemption-free."""
        ratio = self.config.admission_headroom
        if self.kv_cache is None or not self.running:
            return 0
        if self.config.admission_lookahead:
            return self._lookahead_headroom_blocks(newcomer, newcomer_tokens)
        if ratio == 0:
            return 0
        manager = self.kv_cache.manager

        def growth(request: Request) -> int:
            return math.ceil(ratio * max(0, request.max_tokens - request.num_output_tokens))

        running = sum(manager.blocks_needed(r.request_id, r.num_tokens + growth(r)) for r in self.running)
        newcomer_growth = manager.blocks_for_tokens(
            newcomer_tokens + growth(newcomer)
        ) - manager.blocks_for_tokens(newcomer_tokens)
        return running + newcomer_growth

    def _lookahead_headroom_blocks(self, newcomer: Request, newcomer_tokens: int) -> int:
        """Under ``admission_lookahead``: how far the busiest future step's blocks exceed today's, with every
        running request and the newcomer growing one token a step to its ``max_tokens`` and freeing its
        blocks when done. Keeping that many free means no request ever needs to be preempted."""
        assert self.kv_cache is not None
        manager = self.kv_cache.manager
        # (tokens held now, steps until it finishes): t steps from now a request holds tokens + t slots.
        growth = [(r.num_tokens, r.max_tokens - r.num_output_tokens) for r in self.running]
        growth.append((newcomer_tokens, newcomer.max_tokens - newcomer.num_output_tokens))
        held_now = sum(manager.blocks_for_tokens(tokens) for tokens, _ in growth)
        return peak_blocks(growth, manager.block_size) - held_now

    def _reserve_new(
        self, request: Request, total_tokens: int, match: PrefixMatch | None, headroom_blocks: int = 0
    ) -> bool:
        """Blocks for a request being admitted, its cached prefix shared instead of recomputed, leaving
        ``headroom_blocks`` free."""
        if match is None or self.prefix_cache is None or self.kv_cache is None:
            return self._reserve(request, total_tokens, headroom_blocks)
        manager = self.kv_cache.manager
        new_blocks = manager.blocks_for_tokens(total_tokens) - len(match.blocks)
        if new_blocks + headroom_blocks > self.prefix_cache.num_free_after_lock(match):
            return False
        self.prefix_cache.lock(match)
        self._locked_prefix[request] = match.node
        manager.share_prefix(request.request_id, match.blocks)
        manager.allocate(request.request_id, total_tokens)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the request's newly filled blocks to the prefix cache, once they are full."""
        if self.prefix_cache is None or self.kv_cache is None:
            return
        manager = self.kv_cache.manager
        full_blocks = request.num_computed_tokens // manager.block_size
        if full_blocks > self._blocks_in_cache.get(request, 0):
            tokens = request.token_ids[: full_blocks * manager.block_size]
            self.prefix_cache.insert(tokens, manager.block_table(request.request_id))
            self._blocks_in_cache[request] = full_blocks

    def check_integrity(self) -> None:
        """Every block held exactly by the tables and prefix-tree locks that reference it."""
        if self.kv_cache is None:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity(self.kv_cache.manager)
        else:
            self.kv_cache.manager.check_integrity()

    def _reserve(self, request: Request, total_tokens: int, headroom_blocks: int = 0) -> bool:
        """Make sure ``request`` has KV slots for ``total_tokens``, leaving ``headroom_blocks`` free; False
        when the pool is short."""
        if self.kv_cache is None:
            return True
        manager = self.kv_cache.manager
        needed = manager.blocks_needed(request.request_id, total_tokens)
        if needed + headroom_blocks > manager.num_free_blocks:
            return False
        manager.allocate(request.request_id, total_tokens)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._queue_waiting(request, preempted=True)
        out.preempted.append(request)

    def _release(self, request: Request) -> None:
        """Unpin the request's cached prefix, then drop its table: blocks the prefix tree holds stay
        cached (evicted LRU when the pool runs dry), the rest are free at once."""
        node = self._locked_prefix.pop(request, None)
        self._blocks_in_cache.pop(request, None)
        if node is not None and self.prefix_cache is not None:
            self.prefix_cache.unlock(node)
        if self.kv_cache is not None and request.request_id in self.kv_cache.manager:
            self.kv_cache.manager.free(request.request_id)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Retire ``request`` (finished or aborted) and free its blocks at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting


def peak_blocks(growth: Sequence[tuple[int, int]], block_size: int) -> int:
    """The most blocks held at any future step by requests that each hold ``tokens + t`` slots ``t`` steps
    from now and finish after ``steps`` steps, for ``(tokens, steps)`` in ``growth`` (``steps`` >= 1).
    Between two finishes the total only grows, so the peak is at a step just before some request finishes.

    In O(n log n + n * block_size), not O(n^2), as it runs at every admission: with ``tokens + block_size
    - 1 = q * block_size + r`` and ``t = k * block_size + m``, a request holds ``q + k + (r + m >=
    block_size)`` blocks at step ``t``, so the total over the requests still running is their sum of
    ``q``, ``k`` per request, and the count of their ``r`` of at least ``block_size - m``."""
    # (q, r, steps) per request, by finish step; the counts cover the requests still running.
    by_finish = sorted(
        ((*divmod(tokens + block_size - 1, block_size), steps) for tokens, steps in growth),
        key=lambda entry: entry[2],
    )
    quotient_sum = sum(quotient for quotient, _, _ in by_finish)
    residue_counts = [0] * block_size
    for _, residue, _ in by_finish:
        residue_counts[residue] += 1
    running, peak = len(by_finish), 0
    for quotient, residue, steps in by_finish:  # the step before each finish; then that request is done
        k, m = divmod(steps - 1, block_size)
        peak = max(peak, quotient_sum + running * k + sum(residue_counts[block_size - m :]))
        quotient_sum -= quotient
        residue_counts[residue] -= 1
        running -= 1
    return peak
