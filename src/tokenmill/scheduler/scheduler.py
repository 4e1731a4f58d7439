"""Deciding which tokens run in the next forward pass, and taking in what the pass produced.

One rule covers every case: each sequence has ``token_ids`` and ``num_computed_tokens``, and a step
gives each scheduled sequence its uncomputed tokens (a whole prompt, or the one token sampled last step)
under a token budget. With speculative decoding a decoding sequence's uncomputed tokens are its last
token and the proposer's guesses after it, appended as provisional tokens: the step computes them all and
``update`` keeps the ones the rejection sampler accepted (giving back the others' KV slots). With
``chunked_prefill`` a prompt may take just what is left of the budget (or
``prefill_chunk_size``) and continue next step, so long prompts run alongside decodes instead of
stalling them. Running sequences go first, in serving order; when the KV cache cannot hold their next
tokens the last running sequence is preempted (its blocks freed, its tokens kept, recomputed later).
Waiting sequences are then admitted while sequences, tokens and blocks allow (an :class:`AdmissionRule`
decides how many blocks to keep free). The batching modes differ only in admission: ``sequential`` runs
one sequence at a time, ``static`` admits a new batch only once the previous one has wholly finished,
``continuous`` admits at every step. Under the ``priority`` policy a waiting sequence that finds the batch
full or the pool short preempts running sequences of a strictly worse priority (:mod:`.queues`).

The KV cache is a :class:`~tokenmill.cache.kv_cache_manager.KVCacheManager`: without a cache (``none``)
it keeps nothing and admits everything, so the rule above needs no special case.
"""

from collections import abc

from tokenmill.cache.kv_cache_manager import NO_HIT, KVCacheManager, PrefixHit
from tokenmill.config import SchedulerConfig
from tokenmill.outputs import RowLogprobs, SpecDecodeCounts
from tokenmill.scheduler.admission import create_admission_rule
from tokenmill.scheduler.output import ScheduledChunk, SchedulerOutput, SchedulerStats, StepResult
from tokenmill.scheduler.queues import create_queues
from tokenmill.sequence import FinishReason, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.queues = create_queues(config.policy)
        self.admission = create_admission_rule(config, kv)
        self.stats = SchedulerStats()

    @property
    def waiting(self) -> abc.Sequence[Sequence]:
        return self.queues.waiting

    @property
    def running(self) -> abc.Sequence[Sequence]:
        return self.queues.running

    @property
    def has_unfinished(self) -> bool:
        return bool(self.queues.waiting or self.queues.running)

    def add(self, seq: Sequence) -> None:
        self.queues.add_waiting(seq, preempted=False)

    # -- scheduling -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.token_budget
        # In serving order; victims of preemption are taken from the end, so never one scheduled already.
        for seq in list(self.queues.running):
            if seq.status is SequenceStatus.RUNNING:  # not preempted earlier in this loop
                budget -= self._schedule_running(seq, budget, out)
        if self._may_admit(out):
            self._admit_waiting(out)
        return out

    def _chunk_size(self, num_tokens: int, budget: int) -> int:
        """Of ``num_tokens`` uncomputed tokens, how many run this step: all, or with chunked prefill as many
        as the budget allows; 0 when they do not fit."""
        if self.config.chunked_prefill:
            num_tokens = min(num_tokens, budget, self.config.prefill_chunk_size or num_tokens)
        return num_tokens if num_tokens <= budget else 0

    def _schedule_running(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        if seq.draft_token_ids:
            self._attach_drafts(seq, budget)
        num_tokens = self._chunk_size(seq.num_uncomputed_tokens, budget)
        if num_tokens == 0:
            seq.drop_drafts()
            return 0
        end = seq.num_computed_tokens + num_tokens
        while not self.kv.allocate(seq, end):
            victim = self.queues.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return 0
        out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, end, seq.num_draft_tokens))
        return num_tokens

    def _attach_drafts(self, seq: Sequence, budget: int) -> None:
        """Append as many of the proposed tokens as fit after the last one: in the budget (and the chunk
        cap), before ``max_tokens`` and the context end, and in free KV blocks (a guess never preempts)."""
        room = min(
            len(seq.draft_token_ids),
            budget - 1,
            (self.config.prefill_chunk_size or budget) - 1 if self.config.chunked_prefill else budget,
            seq.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        while room > 0 and self.kv.blocks_needed(seq, seq.num_tokens + room) > self.kv.num_free_blocks:
            room -= 1
        if seq.num_uncomputed_tokens != 1:
            room = 0
        seq.attach_drafts(max(room, 0))

    def _may_admit(self, out: SchedulerOutput) -> bool:
        if out.preempted:
            return False  # memory is short: admitting now would only preempt again
        return not (self.config.batching == "static" and self.queues.running)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        while self.queues.waiting:
            seq = self.queues.waiting[0]
            hit = self.kv.match(seq) if _reads_prefix_cache(seq) else NO_HIT
            start = seq.num_computed_tokens + hit.num_tokens
            budget = self.config.token_budget - out.num_tokens
            num_tokens = self._chunk_size(seq.num_tokens - start, budget)
            if num_tokens == 0:
                return
            if not self._admits(seq, start + num_tokens, hit):
                if self._preempt_for(seq, out):
                    continue  # the victim's sequence slot and blocks are free now: try again
                return
            self._record_first_admission(seq, hit)
            seq.num_computed_tokens = start
            self.queues.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.queues.add_running(seq)
            out.chunks.append(ScheduledChunk(seq, start, start + num_tokens))

    def _admits(self, seq: Sequence, num_tokens: int, hit: PrefixHit) -> bool:
        """Whether ``seq`` joins the batch with slots for ``num_tokens`` tokens (taking them if so)."""
        if len(self.queues.running) >= self.config.max_running:
            return False
        keep_free = self.admission.keep_free(self.queues.running, seq, num_tokens)
        return self.kv.allocate(seq, num_tokens, keep_free, hit)

    def _preempt_for(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempt the last running sequence to make room for ``seq`` if the policy lets it (a victim
        scheduled this step loses its chunk); False if not."""
        running = self.queues.running
        if not running or not self.queues.may_preempt_for(seq, running[-1]):
            return False
        victim = running[-1]
        out.chunks = [chunk for chunk in out.chunks if chunk.seq is not victim]
        self._preempt(victim, out)
        return True

    def _record_first_admission(self, seq: Sequence, hit: PrefixHit) -> None:
        """What the prefix cache gave the sequence's first admission. A preempted sequence's later ones
        find its own earlier blocks, which says nothing about prompt reuse, so they are not counted."""
        if seq.num_preemptions:
            return
        seq.num_cached_tokens = hit.num_tokens
        self.stats.prefix_cache_queries += hit.num_query_tokens
        self.stats.prefix_cache_hits += hit.num_tokens

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks, offering its full ones to the prefix cache first. Generated tokens'
        blocks are offered here, once, rather than every time decoding fills one (each offer walks the
        prefix tree from its root: at 256 sequences that took a tenth of every decode step)."""
        self.kv.cache_full_blocks(seq)
        self.kv.free(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.drop_drafts()
        seq.draft_token_ids = []  # guessed for a step it no longer runs in (kept, a later step verified them)
        self.queues.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.queues.add_waiting(seq, preempted=True)
        out.preempted.append(seq)

    # -- after the step ---------------------------------------------------------------------------

    def update(
        self, scheduled: SchedulerOutput, result: StepResult
    ) -> list[tuple[Sequence, int, RowLogprobs | None]]:
        """Take in what the step computed: advance each sequence, offer its full blocks to the prefix
        cache, append the sampled tokens and finish the sequences a token ends (stop token, EOS,
        ``max_tokens``; a token after the one that ends it is dropped). Draft tokens the step rejected
        give their KV slots back. Returns (sequence, token, logprobs) for every kept token, in step order."""
        sampled = []
        for chunk in scheduled.chunks:
            seq = chunk.seq
            tokens = result.sampled.get(seq, [])
            end = chunk.end
            if chunk.num_draft_tokens:
                end -= self._settle_drafts(chunk, len(tokens) - 1)
            computed = self.kv.tokens_kept(end)
            seq.num_computed_tokens = min(computed, seq.num_tokens)
            if chunk.start < seq.num_prompt_tokens:  # prompt blocks are shared as soon as computed
                self.kv.cache_full_blocks(seq)
            seq.prompt_logprobs.extend(result.prompt_logprobs.get(seq, []))
            num_kept = 0
            for token, logprobs in tokens:
                if seq.is_finished:
                    break
                seq.num_computed_tokens = min(computed, seq.num_tokens)  # an accepted draft's KV is kept
                self._append_token(seq, token)
                sampled.append((seq, token, logprobs))
                num_kept += 1
            if not seq.is_finished:
                seq.num_computed_tokens = min(computed, seq.num_tokens)
            if chunk.num_draft_tokens:
                seq.spec.num_emitted += num_kept
                self.stats.spec_decode.num_emitted += num_kept
        return sampled

    def _settle_drafts(self, chunk: ScheduledChunk, num_accepted: int) -> int:
        """Remove ``chunk``'s provisional tokens (the accepted ones come back as sampled tokens), give back
        the rejected ones' KV slots and count the step; returns how many were rejected."""
        seq = chunk.seq
        rejected = chunk.num_draft_tokens - num_accepted
        seq.drop_drafts()
        self.kv.rollback(seq, rejected)
        step = SpecDecodeCounts(1, chunk.num_draft_tokens, num_accepted, 0)
        seq.spec.add(step)
        self.stats.spec_decode.add(step)
        return rejected

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.append_token(token)
        if token in seq.params.stop_token_ids:
            self.finish(seq, FinishReason.STOP, stop_reason=token)
        elif token in seq.eos_token_ids and not seq.params.ignore_eos:
            self.finish(seq, FinishReason.STOP)
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, FinishReason.LENGTH)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Retire ``seq`` (finished or aborted) and free its blocks at once."""
        seq.drop_drafts()
        seq.draft_token_ids = []
        if seq.status is SequenceStatus.RUNNING:
            self.queues.running.remove(seq)
        elif seq in self.queues.waiting:
            self.queues.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def stop_at_string(self, seq: Sequence, stop_string: str | None, num_later: int) -> None:
        """End ``seq`` at a stop string, dropping the ``num_later`` tokens after it (a verification step
        may have appended them, and may have ended the sequence at the last by length)."""
        if seq.is_finished:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop_string
        else:
            self.finish(seq, FinishReason.STOP, stop_reason=stop_string)
        if num_later:
            del seq.token_ids[-num_later:]

    def reserve_next_step(self, scheduled: SchedulerOutput) -> list[int] | None:
        """For overlapped decoding: the rows of ``scheduled`` (a decode step whose tokens are not read yet)
        whose sequences will almost surely run one token further in the next step, which then runs them
        alone; each gets a slot for that token now (a sequence whose blocks are full takes its next block
        one step before it would; if it ends instead, the block is freed with the others). A sequence that
        ends by length here is left out. None, taking nothing, when the next step may admit a waiting
        sequence, no sequence continues, or the pool is short."""
        rows = [row for row, chunk in enumerate(scheduled.chunks) if self._continues(chunk)]
        if self.queues.waiting and (len(rows) < len(scheduled.chunks) or not self._batch_full()):
            return None
        continuing = [scheduled.chunks[row] for row in rows]
        needed = sum(self.kv.blocks_needed(chunk.seq, chunk.start + 2) for chunk in continuing)
        if not continuing or needed > self.kv.num_free_blocks:
            return None
        for chunk in continuing:
            self.kv.allocate(chunk.seq, chunk.start + 2)
        return rows

    def _batch_full(self) -> bool:
        return len(self.queues.running) >= self.config.max_running

    def _continues(self, chunk: ScheduledChunk) -> bool:
        """Whether the sequence certainly runs one more step, barring a stop token."""
        seq = chunk.seq
        return seq.num_output_tokens + 1 < seq.max_tokens and chunk.start + 2 < self.max_model_len

    def check_integrity(self) -> None:
        """Every block held exactly by the tables and prefix-tree locks that reference it."""
        self.kv.check_integrity()


def _reads_prefix_cache(seq: Sequence) -> bool:
    """Whether admission looks ``seq`` up: only from scratch (new, or preempted), and not when prompt
    logprobs need every prompt position computed."""
    return not seq.num_computed_tokens and seq.params.prompt_logprobs is None
