"""``LLMEngine``: requests in, per-step token deltas out. The server and the offline ``LLM`` sit on it.

The engine builds its parts in order (model with its kernels bound, attention backend, sampler, KV
cache sized for the device, runner, scheduler) and then is a thin loop: each ``step()`` asks the
scheduler what to run, has the runner execute it, and hands the result back to the scheduler
(``schedule -> execute -> update``); it adds the text, stop strings and per-request bookkeeping.
``add_request`` and ``abort`` may be called between steps.
"""

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence as SequenceOf

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.grammar_steps import advance_grammars, fill_masks_ahead
from tokenmill.engine.hardware_defaults import Platform, resolve_config, resolve_device
from tokenmill.engine.input_checks import (
    InvalidRequestError,
    check_priority,
    check_request_types,
    check_token_ids,
    prompt_token_ids,
    resolve_max_tokens,
)
from tokenmill.engine.request_setup import (
    RequestSetup,
    check_cache_salt,
    encode_bad_words,
    ends_at_stop_token,
)
from tokenmill.engine.runner_setup import build_runner
from tokenmill.engine.startup_report import StartupTimes, describe_startup
from tokenmill.engine.stop_strings import StopStringDetokenizer
from tokenmill.engine.warm_start import WarmStartReport, warm_up_waves
from tokenmill.generation_config import sampling_defaults
from tokenmill.loading import LoadedModel
from tokenmill.loading.loader import load_model_for
from tokenmill.outputs import RequestDelta, RowLogprobs
from tokenmill.parallel.engine_setup import start_workers
from tokenmill.runner.kv_cache import KVCache
from tokenmill.runner.model_runner import PendingStep
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import SchedulerStats
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.sequence import FinishReason, Sequence
from tokenmill.speculative.factory import create_proposer
from tokenmill.speculative.guessing import GuessingRounds
from tokenmill.structured.backend import CompiledGrammar
from tokenmill.structured.manager import StructuredOutputs
from tokenmill.tokenizer import Tokenizer

__all__ = ["InvalidRequestError", "LLMEngine", "resolve_device"]
logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192


@dataclasses.dataclass(frozen=True)
class KVCacheMemory:
    used_bytes: int  # held by sequences now
    pool_bytes: int  # the whole pool


class LLMEngine:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, draft: LoadedModel | None = None
    ) -> None:
        """``loaded`` / ``draft``: the model / draft model (speculative decoding), loaded already."""
        started = time.perf_counter()
        self.device = resolve_device(config.device)
        self.workers = start_workers(config, self.device, loaded is not None or draft is not None)
        with self._parallel_guard("start-up"):
            self._build(config, loaded, draft, started)

    def _build(
        self, config: EngineConfig, loaded: LoadedModel | None, draft: LoadedModel | None, started: float
    ) -> None:
        self.loaded = loaded or load_model_for(config, self.device)
        self.load_seconds = time.perf_counter() - started
        self.model_config = self.loaded.config
        self.tokenizer: Tokenizer | None = self.loaded.tokenizer
        self.max_model_len = self._max_model_len(config)
        # Every auto setting decided for this hardware: what the rest of the engine reads.
        platform = Platform.detect(self.device)
        self.config = resolve_config(config, platform, self.max_model_len, self.loaded.quantization)
        if self.config.host_threads is not None:
            torch.set_num_threads(self.config.host_threads)
        self._check_token_budget()
        self.eos_token_ids = self._eos_token_ids()
        self.sampling_defaults = sampling_defaults(config, self.loaded.generation_config, self.loaded.source)
        self.structured_outputs = StructuredOutputs(
            config.structured_output_backend,
            self.tokenizer,
            self.model_config.vocab_size,
            sorted(self.eos_token_ids),
            self.device,
        )
        self.runner, self.kernel_options = build_runner(
            self.config,
            self.loaded,
            self.model_config,
            self.max_model_len,
            self.device,
            self.structured_outputs,
            self.workers,
        )
        self.kv_cache: KVCache = self.runner.kv
        self.proposer = create_proposer(
            self.config, self.loaded, self.max_model_len, self.kernel_options, draft
        )
        self.scheduler = Scheduler(self.config.scheduler, self.kv_cache.manager, self.max_model_len)
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n sequences
        self.texts: dict[Sequence, StopStringDetokenizer] = {}
        self._pending: list[RequestDelta] = []
        self.guessing = GuessingRounds(self.max_model_len, self.config.speculative.disable_by_batch_size)
        self.warm_start = self.warm_up() if self.config.warm_start else None
        torch.manual_seed(config.seed)
        self.startup_seconds = time.perf_counter() - started
        logger.info(self.describe_startup())

    def _parallel_guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        """With worker processes: a failure stops them all and names a rank that died."""
        return self.workers.guard(what) if self.workers is not None else contextlib.nullcontext()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them); the engine cannot step after."""
        if self.workers is not None:
            self.runner.release_graphs()  # NCCL cannot leave a group whose collectives live graphs hold
            self.workers.shutdown()

    def warm_up(self) -> WarmStartReport:
        """Run synthetic requests through every kernel the engine can hit (see :mod:`.warm_start`), then
        forget them: the prefix cache is emptied and the scheduler's counters start again."""
        started = time.perf_counter()
        scheduler = self.config.scheduler
        vocab = self.model_config.vocab_size
        self.runner.sampler.compile_kernels(vocab, scheduler.max_running, self.device)
        waves = warm_up_waves(
            min(self.max_model_len, self.kv_cache.manager.capacity_tokens),
            scheduler.token_budget,
            scheduler.max_running,
            vocab,
        )
        num_steps = 0
        for wave in waves:
            for request_id, prompt, params in wave:
                self.add_request(request_id, prompt, params)
            self.step()
            num_steps += 1
        while self.has_unfinished_requests():
            self.step()
            num_steps += 1
        self.reset_prefix_cache()
        self.scheduler.stats = SchedulerStats()
        return WarmStartReport(sum(map(len, waves)), num_steps, time.perf_counter() - started)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix that no running request holds."""
        self.kv_cache.manager.reset_prefix_cache()

    def describe_startup(self) -> str:
        """One line: the path resolved for this hardware, the KV pool, graphs, and start-up time."""
        return describe_startup(
            self.config,
            self.device,
            self.kernel_options,
            self.runner.graph_capture,
            self.kv_cache,
            StartupTimes(self.startup_seconds, self.load_seconds, self.warm_start),
            self.runner.prefill_capture,
        )

    def _max_model_len(self, config: EngineConfig) -> int:
        model_limit = self.loaded.position_limit()
        wanted = config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
        if wanted > model_limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {model_limit} positions")
        return wanted

    def _check_token_budget(self) -> None:
        scheduler = self.config.scheduler
        if scheduler.token_budget < self.max_model_len and not scheduler.chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens ({scheduler.token_budget}) is smaller than "
                f"max_model_len ({self.max_model_len}): a full-length prompt could never be scheduled "
                "(turn on chunked_prefill to split prompts across steps)"
            )

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.loaded.eos_token_ids)
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | SequenceOf[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Queue a request (``params.n`` sequences); returns its prompt token ids. ``priority``: lower is
        served first, under the ``priority`` scheduling policy only. ``cache_salt``: the request shares
        prefix-cache blocks only with requests of the same salt (None: the unsalted ones)."""
        check_request_types(request_id, params)
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        check_priority(priority, self.config.scheduler.policy == "priority")
        check_cache_salt(cache_salt)
        vocab_size = self.model_config.vocab_size
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, vocab_size)
        max_tokens = resolve_max_tokens(
            len(prompt_ids),
            params,
            self.max_model_len,
            self.kv_cache.manager.capacity_tokens,
            self.tokenizer is not None,
        )
        check_token_ids(params, vocab_size)
        bad_words = encode_bad_words(params, self.tokenizer, vocab_size, self.eos_token_ids)
        grammar = self._compile_grammar(params)
        setup = RequestSetup(prompt_ids, max_tokens, priority, cache_salt, bad_words, grammar)
        seqs = [self._sequence(request_id, index, params, setup) for index in range(params.n)]
        self.requests[request_id] = seqs
        for seq in seqs:
            self.texts[seq] = StopStringDetokenizer(self.tokenizer, prompt_ids, params)
            self.scheduler.add(seq)
        return prompt_ids

    def _sequence(self, request_id: str, index: int, params: SamplingParams, setup: RequestSetup) -> Sequence:
        """Sequence ``index`` of the request: its own id and seed when the request asks for several, and
        its own matcher when it has a grammar."""
        if params.n > 1 and params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        seq_id = request_id if params.n == 1 else f"{request_id}[{index}]"
        grammar = setup.grammar
        return Sequence(
            seq_id,
            setup.prompt_ids,
            params,
            setup.max_tokens,
            self.eos_token_ids,
            priority=setup.priority,
            request_id=request_id,
            index=index,
            grammar=grammar.matcher() if grammar is not None else None,
            bad_words=setup.bad_words,
            cache_salt=setup.cache_salt,
        )

    def _compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's structured-output grammar (cached); a bad one raises, naming its field."""
        if params.structured_outputs is None:
            return None
        return self.structured_outputs.compile(params.structured_outputs)

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` now: its KV blocks are freed at once, and the next ``step()`` reports it."""
        for seq in self.requests.get(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
                self._pending.append(self._delta(seq, [], None))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._pending)

    # -- stepping ---------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        if self.proposer is not None:
            self.guessing.propose(self.proposer, self.scheduler.running, self.runner.started_sequences())
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            deltas, self._pending = self._pending, []
            return self._forget_finished(deltas)
        with self._parallel_guard("step"):
            step = self.runner.execute(scheduled.chunks)  # if it raises, pending abort deltas are kept
            rows = self.scheduler.reserve_next_step(scheduled) if self._can_start_next_step(step) else None
            if rows is not None:
                self.runner.start_next_step(step, rows)
            result = step.result()
        deltas, self._pending = self._pending, []
        sampled = self.scheduler.update(scheduled, result)
        remaining = collections.Counter(seq for seq, _, _ in sampled)  # tokens of each still to come
        constrained = [(seq, token) for seq, token, _ in sampled if seq.grammar is not None]
        one_each = len(constrained) == len({seq for seq, _ in constrained})
        if constrained and one_each:  # every matcher moves at once; their next masks fill meanwhile
            advance_grammars(self.structured_outputs, self.scheduler, constrained)
            self._fill_masks_ahead()
        cut: set[Sequence] = set()  # sequences a stop string ended before their last token of this step
        for seq, token, logprobs in sampled:
            remaining[seq] -= 1
            if seq in cut:
                continue
            if seq.grammar is not None and not one_each:
                advance_grammars(self.structured_outputs, self.scheduler, [(seq, token)])
            delta, stopped = self._token_delta(seq, token, logprobs, remaining[seq])
            deltas.append(delta)
            if stopped:
                cut.add(seq)
        if constrained and not one_each:
            self._fill_masks_ahead()
        if self.config.debug_checks:
            self.scheduler.check_integrity()
        return self._forget_finished(deltas)

    def _can_start_next_step(self, step: PendingStep) -> bool:
        """Whether to enqueue the decode step after ``step`` before reading it (overlapped decode); with a
        proposer, as :class:`~tokenmill.speculative.guessing.GuessingRounds` allows. If guesses come, or
        the batch changes, the started step does not match the next one and is dropped."""
        if not self.runner.can_start_next_step(step):
            return False
        return self.proposer is None or self.guessing.allows_start_ahead(len(self.scheduler.running))

    def _fill_masks_ahead(self) -> None:
        """Start filling the next masks in the background (``structured_masks_ahead``), while the host
        turns this step's tokens into text and schedules the next step."""
        if self.config.structured_masks_ahead:
            fill_masks_ahead(self.structured_outputs, self.scheduler.running)

    def _token_delta(
        self, seq: Sequence, token: int, logprobs: RowLogprobs | None, num_later: int = 0
    ) -> tuple[RequestDelta, bool]:
        """The delta of a newly sampled token: its text, and the end of the sequence at a stop string
        (``num_later``: tokens the same step appended after this one, dropped if it ends here); and
        whether a stop string ended it here."""
        text = self.texts[seq]
        num_output = seq.num_output_tokens - num_later
        shown = [] if ends_at_stop_token(seq, token, num_later) else [token]
        stop_string = text.append(shown, check_stop=num_output > seq.params.min_tokens)
        stopped = stop_string is not None  # it ends the text even where the token also ended the sequence
        if stopped:
            self.scheduler.stop_at_string(seq, stop_string, num_later)
        last = stopped or num_later == 0  # the sequence's last token of this step
        if seq.is_finished and last and not stopped:
            text.finish()
        delta = self._delta(seq, [token], logprobs, last)
        if seq.num_output_tokens == 1 and seq.params.prompt_logprobs is not None:
            delta.prompt_logprobs = [None, *seq.prompt_logprobs]
        return delta, stopped

    def _delta(
        self, seq: Sequence, tokens: list[int], logprobs: RowLogprobs | None, last: bool = True
    ) -> RequestDelta:
        """``last``: no later token of this step follows (only the last one reports the end)."""
        finished = seq.is_finished and last
        return RequestDelta(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=tokens,
            new_text=self.texts[seq].release(finished),
            new_logprobs=[logprobs] if logprobs is not None else None,
            finish_reason=str(seq.finish_reason) if finished and seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            spec_decode=seq.spec.snapshot() if self.proposer is not None else None,
        )

    def _forget_finished(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        for delta in deltas:
            if delta.finished:
                seqs = self.requests.get(delta.request_id, [])
                if all(seq.is_finished for seq in seqs):
                    for seq in seqs:
                        self.texts.pop(seq, None)
                    self.requests.pop(delta.request_id, None)
        return deltas

    # -- introspection ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def scheduler_stats(self) -> SchedulerStats:
        """A copy of the scheduler's counters: preemptions, prefix-cache queries and hits (in tokens)."""
        stats = self.scheduler.stats
        return dataclasses.replace(stats, spec_decode=dataclasses.replace(stats.spec_decode))

    def kv_cache_usage(self) -> float:
        return self.kv_cache.manager.usage()

    def kv_cache_memory(self) -> KVCacheMemory:
        return KVCacheMemory(self.kv_cache.used_bytes(), self.kv_cache.pool_bytes())
