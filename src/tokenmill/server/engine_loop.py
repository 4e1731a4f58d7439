"""The bridge between the HTTP event loop and the engine: the engine runs in a thread of its own.

The thread steps the engine whenever any request is in flight, so one step serves every request at once
and no HTTP handler ever waits on a forward pass. Handlers hand it commands (add, abort, call) through a
thread-safe queue; the thread applies them between steps and routes each step's deltas back to the
handlers' asyncio queues with ``loop.call_soon_threadsafe`` (one call per step and event loop).

An exception inside ``engine.step()`` fails the requests in flight (each gets a 500) and aborts them, so
their KV blocks are freed; the loop goes on. Only if the loop itself breaks does the thread end, and
``is_healthy`` turns False.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeAlias

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.outputs import RequestDelta
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.metrics import EngineStats, ServerMetrics
from tokenmill.server.request_timeline import RequestTimeline, StepTokenCounter

logger = logging.getLogger(__name__)

# How long the idle thread waits for a command before looking around again (it wakes at once on one).
_IDLE_WAIT_S = 1.0


@dataclass(frozen=True)
class Accepted:
    """Every prompt of the request was queued; their token ids, in order."""

    prompt_token_ids: list[list[int]]


@dataclass(frozen=True)
class Failed:
    """The request was refused or failed; answer ``status_code`` with ``message``."""

    status_code: int
    message: str
    param: str | None = None


StreamItem: TypeAlias = Accepted | Failed | RequestDelta


class RequestStream:
    """Where the engine thread delivers one HTTP request's items; read on the event loop that made it."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()


@dataclass(frozen=True)
class PromptSpec:
    """One engine request: a prompt (text or token ids), its sampling parameters and priority."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0


@dataclass
class _Tracked:
    """An engine request whose deltas go to ``stream``."""

    stream: RequestStream
    timeline: RequestTimeline
    num_sequences: int
    num_finished: int = 0
    last_token_time: dict[int, float] = field(default_factory=dict)  # per sequence index

    @property
    def arrival_time(self) -> float:
        return self.timeline.arrival_time


@dataclass(frozen=True)
class _Add:
    specs: list[PromptSpec]
    stream: RequestStream
    arrival_time: float

    @property
    def num_sequences(self) -> int:
        return sum(spec.params.n for spec in self.specs)


@dataclass(frozen=True)
class _Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class _Call:
    function: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


class _Stop:
    pass


_Command: TypeAlias = _Add | _Abort | _Call | _Stop


class EngineLoopStoppedError(TokenmillError):
    """The engine loop is not running (never started, stopped, or died), so it takes no work."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.failure: BaseException | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # touched by the engine thread only
        self._lock = threading.Lock()  # guards the fields below
        self._accepting = False
        self._queued_sequences = 0  # submitted, not yet applied by the engine thread
        self._stats = EngineStats()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine-loop", daemon=True)

    # -- control, from any thread -----------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            self._accepting = True
        self._publish_stats()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the thread to finish and wait for it; requests still in flight fail with a 503."""
        self._put(_Stop(), force=True)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats

    def load(self) -> tuple[EngineStats, int]:
        """The engine's last published state and the sequences submitted since, read together."""
        with self._lock:
            return self._stats, self._queued_sequences

    # -- work, from the event loop ----------------------------------------------------------------

    def submit(self, specs: Sequence[PromptSpec], stream: RequestStream) -> None:
        """Queue ``specs`` as one unit: the stream gets ``Accepted`` (then deltas) or one ``Failed``."""
        self._put(_Add(list(specs), stream, time.monotonic()))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these engine requests; no more of their deltas are delivered. Unknown ids are ignored."""
        with contextlib.suppress(EngineLoopStoppedError):  # if nothing runs, there is nothing to abort
            self._put(_Abort(list(request_ids)))

    def call(self, function: Callable[[LLMEngine], Any]) -> concurrent.futures.Future[Any]:
        """Run ``function(engine)`` on the engine thread between two steps; its result comes as a future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._put(_Call(function, future))
        return future

    def _put(self, command: _Command, force: bool = False) -> None:
        # Under the lock, so that a command is either refused or seen by the thread's final drain.
        with self._lock:
            if not self._accepting and not force:
                raise EngineLoopStoppedError("the engine loop is not running")
            if isinstance(command, _Add):
                self._queued_sequences += command.num_sequences
            self._commands.put(command)

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._apply_commands(wait=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
            self._shut_down(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        except BaseException as exc:
            self.failure = exc
            logger.exception("the engine loop died")
            self._shut_down(HTTPStatus.INTERNAL_SERVER_ERROR, f"the engine loop died: {exc!r}")

    def _apply_commands(self, wait: bool) -> bool:
        """Apply every queued command; False once asked to stop. ``wait``: block until one comes."""
        commands: list[_Command] = []
        if wait:
            try:
                commands.append(self._commands.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                return True
        while not self._commands.empty():
            commands.append(self._commands.get_nowait())
        deliveries = _Deliveries()
        applied_sequences = 0
        for command in commands:
            if isinstance(command, _Stop):
                self._put_back(commands[commands.index(command) + 1 :])
                deliveries.send()
                return False
            if isinstance(command, _Add):
                applied_sequences += command.num_sequences
            self._apply(command, deliveries)
        deliveries.send()
        with self._lock:
            self._queued_sequences -= applied_sequences
            self._stats = self._snapshot()
        return True

    def _put_back(self, commands: list[_Command]) -> None:
        for command in commands:
            self._commands.put(command)

    def _apply(self, command: _Command, deliveries: "_Deliveries") -> None:
        if isinstance(command, _Add):
            self._add(command, deliveries)
        elif isinstance(command, _Abort):
            for request_id in command.request_ids:
                if self._tracked.pop(request_id, None) is not None:
                    self.engine.abort(request_id)
        elif isinstance(command, _Call):
            _run_call(command, self.engine)

    def _add(self, command: _Add, deliveries: "_Deliveries") -> None:
        added: list[list[int]] = []
        try:
            for spec in command.specs:
                added.append(
                    self.engine.add_request(spec.request_id, spec.prompt, spec.params, spec.priority)
                )
        except (TokenmillError, ValueError) as exc:  # InvalidRequestError, TokenizerError, ...
            self._undo_add(command.specs[: len(added)])
            deliveries.add(command.stream, Failed(HTTPStatus.BAD_REQUEST, str(exc), _param_in(str(exc))))
            return
        except Exception as exc:
            logger.exception("adding a request failed")
            self._undo_add(command.specs[: len(added)])
            deliveries.add(command.stream, Failed(HTTPStatus.INTERNAL_SERVER_ERROR, f"adding failed: {exc}"))
            return
        for spec, prompt_ids in zip(command.specs, added, strict=True):
            timeline = RequestTimeline(
                command.arrival_time, list(self.engine.requests.get(spec.request_id, []))
            )
            self._tracked[spec.request_id] = _Tracked(command.stream, timeline, spec.params.n)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(prompt_ids))
        deliveries.add(command.stream, Accepted(added))

    def _undo_add(self, specs: Sequence[PromptSpec]) -> None:
        for spec in specs:
            self.engine.abort(spec.request_id)

    def _step(self) -> None:
        step_start = time.monotonic()
        counter = StepTokenCounter(seq for tracked in self._tracked.values() for seq in tracked.timeline.seqs)
        try:
            deltas = self.engine.step()
        except Exception as exc:
            logger.exception("an engine step failed; failing the requests in flight")
            self._fail_in_flight(f"the engine failed while generating: {exc!r}")
            return
        if self.metrics is not None:
            self.metrics.iteration_tokens.observe(counter.count())
            for tracked in self._tracked.values():
                tracked.timeline.observe_step(step_start)
        deliveries = _Deliveries()
        now = time.monotonic()
        for delta in deltas:
            self._route(delta, now, deliveries)
        deliveries.send()

    def _route(self, delta: RequestDelta, now: float, deliveries: "_Deliveries") -> None:
        tracked = self._tracked.get(delta.request_id)
        if tracked is None:
            return  # aborted by its client: nobody listens any more
        deliveries.add(tracked.stream, delta)
        if self.metrics is not None:
            self._observe(tracked, delta, now)
        if delta.finished:
            tracked.num_finished += 1
            if tracked.num_finished == tracked.num_sequences:
                del self._tracked[delta.request_id]
                if self.metrics is not None:
                    self.metrics.request_finished(tracked.timeline.finished(str(delta.finish_reason), now))

    def _observe(self, tracked: _Tracked, delta: RequestDelta, now: float) -> None:
        assert self.metrics is not None
        tracked.timeline.observe_tokens(delta.index, len(delta.new_token_ids), now)
        if delta.new_token_ids:
            self.metrics.generation_tokens.inc(len(delta.new_token_ids))
            previous = tracked.last_token_time.get(delta.index)
            if previous is None:
                self.metrics.time_to_first_token.observe(now - tracked.arrival_time)
            else:
                self.metrics.inter_token_latency.observe(now - previous)
            tracked.last_token_time[delta.index] = now

    def _fail_in_flight(self, message: str) -> None:
        """Fail every tracked request with a 500 and abort it in the engine (freeing its KV blocks)."""
        deliveries = _Deliveries()
        for request_id, tracked in self._tracked.items():
            self.engine.abort(request_id)
            deliveries.add(tracked.stream, Failed(HTTPStatus.INTERNAL_SERVER_ERROR, message))
        self._tracked.clear()
        deliveries.send()

    def _shut_down(self, status_code: int, message: str) -> None:
        """Refuse new work, then answer everything in flight or still queued with ``status_code``."""
        with self._lock:
            self._accepting = False
        deliveries = _Deliveries()
        for tracked in self._tracked.values():
            deliveries.add(tracked.stream, Failed(status_code, message))
        self._tracked.clear()
        while not self._commands.empty():
            command = self._commands.get_nowait()
            if isinstance(command, _Add):
                deliveries.add(command.stream, Failed(status_code, message))
            elif isinstance(command, _Call):
                command.future.set_exception(EngineLoopStoppedError(message))
        deliveries.send()

    def _publish_stats(self) -> None:
        stats = self._snapshot()
        with self._lock:
            self._stats = stats

    def _snapshot(self) -> EngineStats:
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


class _Deliveries:
    """Items for the event loops' queues, handed over with one ``call_soon_threadsafe`` per loop."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamItem]]] = defaultdict(
            list
        )

    def add(self, stream: RequestStream, item: StreamItem) -> None:
        self._by_loop[stream.loop].append((stream, item))

    def send(self) -> None:
        for loop, items in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: the server is gone
                logger.debug("dropping %d items for a closed event loop", len(items))
        self._by_loop.clear()


def _put_all(items: list[tuple[RequestStream, StreamItem]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _run_call(command: _Call, engine: LLMEngine) -> None:
    try:
        command.future.set_result(command.function(engine))
    except Exception as exc:
        command.future.set_exception(exc)


_PARAM_NAMES = ("priority", "max_tokens", "stop_token_ids", "logit_bias", "stop", "prompt")


def _param_in(message: str) -> str | None:
    """The request parameter an engine error message is about, if it names one."""
    return next((name for name in _PARAM_NAMES if name in message), None)
