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
"""

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.cache.radix_cache import PrefixMatch, RadixCache, RadixNode
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.request import FinishReason, Request, RequestStatus


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
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache: RadixCache | None = None
        if config.prefix_caching and kv_cache is not None:
            self.prefix_cache = RadixCache.for_manager(kv_cache.manager)
        self._locked_prefix: dict[Request, RadixNode] = {}  # the cached prefix each running request pins
        self._blocks_in_cache: dict[Request, int] = {}  # how many of its full blocks were inserted

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Oldest first; victims of preemption are taken from the end, so never one scheduled already.
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            budget -= self._schedule_running(request, budget, out)
        if self._may_admit(out):
            self._admit_waiting(budget, out)
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

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            request = self.waiting[0]
            match = self._match_prefix(request)
            cached = match.num_tokens if match is not None else 0
            start = request.num_computed_tokens + cached
            num_tokens = self._chunk_size(request.num_tokens - start, budget)
            if num_tokens == 0 or not self._reserve_new(request, start + num_tokens, match):
                return
            request.num_computed_tokens = start
            request.num_cached_tokens = cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, start, start + num_tokens))
            budget -= num_tokens

    def _match_prefix(self, request: Request) -> PrefixMatch | None:
        """The longest cached prefix of a request starting from scratch (new, or preempted)."""
        if (
            self.prefix_cache is None
            or request.num_computed_tokens
            or request.params.prompt_logprobs is not None
        ):
            return None  # prompt logprobs need every prompt position computed
        match = self.prefix_cache.match_prefix(request.token_ids)
        return match if match.blocks else None

    def _reserve_new(self, request: Request, total_tokens: int, match: PrefixMatch | None) -> bool:
        """Blocks for a request being admitted, its cached prefix shared instead of recomputed."""
        if match is None or self.prefix_cache is None or self.kv_cache is None:
            return self._reserve(request, total_tokens)
        manager = self.kv_cache.manager
        new_blocks = manager.blocks_for_tokens(total_tokens) - len(match.blocks)
        if new_blocks > self.prefix_cache.num_free_after_lock(match):
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

    def _reserve(self, request: Request, total_tokens: int) -> bool:
        """Make sure ``request`` has KV slots for ``total_tokens``; False when the pool is short."""
        if self.kv_cache is None:
            return True
        manager = self.kv_cache.manager
        if not manager.can_allocate(total_tokens, request.request_id):
            return False
        manager.allocate(request.request_id, total_tokens)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
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
