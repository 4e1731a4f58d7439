"""The engine side of the server: engine requests in, each step's deltas and metric observations out.

Both ways of running the engine use it: ``EngineLoop`` in a thread of the HTTP process, and the engine
process (``engine_process.py``) across a pipe. It knows nothing of HTTP, streams or event loops: it
tracks the engine requests the server still wants, infers the per-request phases the metrics need (the
engine reports no scheduling events), and says what happened as plain data.

An exception inside ``engine.step()`` fails the requests in flight and aborts them, so their KV blocks
are freed; the caller answers them and goes on.
"""

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.outputs import RequestDelta
from tokenmill.parallel.launcher import TensorParallelError
from tokenmill.server.engine_messages import Accepted, EngineFacts, Failed, PromptSpec
from tokenmill.server.metrics import EngineStats
from tokenmill.server.request_timeline import RequestTimeline, StepMetrics, StepTokenCounter

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """An engine request the server still wants the deltas of."""

    timeline: RequestTimeline
    num_sequences: int
    num_finished: int = 0
    last_token_time: dict[int, float] = field(default_factory=dict)  # per sequence index


@dataclass
class StepOutcome:
    """One step: the deltas of tracked requests, the requests it finished, or the failure that ended
    every request in flight (each aborted in the engine already)."""

    deltas: list[RequestDelta] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    failure: Failed | None = None


class EngineCore:
    def __init__(self, engine: LLMEngine, observe: bool = True) -> None:
        """``observe``: gather metric observations (``take_metrics``)."""
        self.engine = engine
        self.observe = observe
        self._tracked: dict[str, _Tracked] = {}
        self._metrics = StepMetrics()

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def tracked(self) -> list[str]:
        return list(self._tracked)

    def take_metrics(self) -> StepMetrics:
        """The observations since the last call."""
        observed, self._metrics = self._metrics, StepMetrics()
        return observed

    def add(self, specs: Sequence[PromptSpec], arrival_time: float) -> Accepted | Failed:
        """Queue every spec, or none: a refused one undoes the ones before it."""
        added: list[list[int]] = []
        try:
            for spec in specs:
                ids = self.engine.add_request(
                    spec.request_id, spec.prompt, spec.params, spec.priority, spec.cache_salt
                )
                added.append(ids)
        except (TokenmillError, ValueError) as exc:  # InvalidRequestError, TokenizerError, ...
            self._undo_add(specs[: len(added)])
            return Failed(HTTPStatus.BAD_REQUEST, str(exc), _param_in(str(exc)))
        except Exception as exc:
            logger.exception("adding a request failed")
            self._undo_add(specs[: len(added)])
            return Failed(HTTPStatus.INTERNAL_SERVER_ERROR, f"adding failed: {exc}")
        for spec, prompt_ids in zip(specs, added, strict=True):
            timeline = RequestTimeline(arrival_time, list(self.engine.requests.get(spec.request_id, [])))
            self._tracked[spec.request_id] = _Tracked(timeline, spec.params.n)
            self._metrics.prompt_tokens += len(prompt_ids)
        return Accepted(added)

    def _undo_add(self, specs: Sequence[PromptSpec]) -> None:
        for spec in specs:
            self.engine.abort(spec.request_id)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these requests; no more of their deltas come out. Unknown ids are ignored."""
        for request_id in request_ids:
            if self._tracked.pop(request_id, None) is not None:
                self.engine.abort(request_id)

    def step(self) -> StepOutcome:
        step_start = time.monotonic()
        counter = StepTokenCounter(seq for tracked in self._tracked.values() for seq in tracked.timeline.seqs)
        try:
            deltas = self.engine.step()
        except TensorParallelError:
            raise  # a rank is gone: no later step can run (the engine process reports it and exits)
        except Exception as exc:
            logger.exception("an engine step failed; failing the requests in flight")
            return self._fail_in_flight(f"the engine failed while generating: {exc!r}")
        if self.observe:
            self._metrics.iteration_tokens.append(counter.count())
            for tracked in self._tracked.values():
                tracked.timeline.observe_step(step_start)
        outcome = StepOutcome()
        now = time.monotonic()
        for delta in deltas:
            self._route(delta, now, outcome)
        return outcome

    def _route(self, delta: RequestDelta, now: float, outcome: StepOutcome) -> None:
        tracked = self._tracked.get(delta.request_id)
        if tracked is None:
            return  # aborted by its client: nobody listens any more
        outcome.deltas.append(delta)
        if self.observe:
            self._observe(tracked, delta, now)
        if delta.finished:
            tracked.num_finished += 1
            if tracked.num_finished == tracked.num_sequences:
                del self._tracked[delta.request_id]
                outcome.done.append(delta.request_id)
                if self.observe:
                    self._metrics.finished.append(tracked.timeline.finished(str(delta.finish_reason), now))

    def _observe(self, tracked: _Tracked, delta: RequestDelta, now: float) -> None:
        tracked.timeline.observe_tokens(delta.index, len(delta.new_token_ids), now)
        if delta.new_token_ids:
            self._metrics.generation_tokens += len(delta.new_token_ids)
            previous = tracked.last_token_time.get(delta.index)
            if previous is None:
                self._metrics.time_to_first_token.append(now - tracked.timeline.arrival_time)
            else:
                self._metrics.inter_token_latency.append(now - previous)
            tracked.last_token_time[delta.index] = now

    def _fail_in_flight(self, message: str) -> StepOutcome:
        """Abort every tracked request in the engine (freeing its KV blocks); the caller answers them."""
        failed = list(self._tracked)
        for request_id in failed:
            self.engine.abort(request_id)
        self._tracked.clear()
        return StepOutcome(failed=failed, failure=Failed(HTTPStatus.INTERNAL_SERVER_ERROR, message))

    def snapshot(self) -> EngineStats:
        engine = self.engine
        scheduler_stats = engine.scheduler_stats()
        return EngineStats(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            kv_cache_usage=engine.kv_cache_usage(),
            num_preemptions=scheduler_stats.num_preemptions,
            prefix_cache_queries=scheduler_stats.prefix_cache_queries,
            prefix_cache_hits=scheduler_stats.prefix_cache_hits,
            spec_decode=scheduler_stats.spec_decode,
        )


def engine_facts(engine: LLMEngine, with_tokenizer: bool = True) -> EngineFacts:
    """What the HTTP side needs to know of ``engine``."""
    labels = {name: str(value) for name, value in dataclasses.asdict(engine.config.kv).items()}
    labels["capacity_tokens"] = str(engine.kv_cache.manager.capacity_tokens)
    return EngineFacts(
        source=engine.loaded.source,
        model=engine.config.model,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        max_running=engine.config.scheduler.max_running,
        cache_labels=labels,
        eos_token_ids=tuple(sorted(engine.eos_token_ids)),
        structured_output_backend=engine.config.structured_output_backend,
        tokenizer=engine.tokenizer if with_tokenizer else None,
        sampling_defaults=dict(engine.sampling_defaults),
    )


_PARAM_NAMES = (
    "allowed_token_ids",
    "bad_words",
    "cache_salt",
    "priority",
    "max_tokens",
    "stop_token_ids",
    "logit_bias",
    "stop",
    "prompt",
)


def _param_in(message: str) -> str | None:
    """The request parameter an engine error message is about, if it names one."""
    return next((name for name in _PARAM_NAMES if name in message), None)
