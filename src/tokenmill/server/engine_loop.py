"""The engine in a thread of the HTTP process (``--no-engine-process``): the simpler way, kept to measure
what the engine process buys.

The thread steps the engine whenever any request is in flight, so one step serves every request at once
and no HTTP handler ever waits on a forward pass. Handlers hand it commands (add, abort, call) through a
thread-safe queue; the thread applies them between steps (``EngineCore``) and routes each step's deltas
back to the handlers' asyncio queues (``Deliveries``). Its cost: the step loop and the event loop share
one GIL, so tokenizing, JSON and SSE encoding slow the steps down (``engine_client.py`` avoids that).

A failed step fails the requests in flight (each gets a 500) and the loop goes on. Only if the loop itself
breaks does the thread end, and ``is_healthy`` turns False.
"""

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeAlias

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.server.engine_core import EngineCore
from tokenmill.server.engine_messages import Accepted, Failed, PromptSpec, StreamItem
from tokenmill.server.metrics import EngineStats, ServerMetrics
from tokenmill.server.streams import Deliveries, RequestStream

__all__ = ["Accepted", "EngineLoop", "EngineLoopStoppedError", "Failed", "PromptSpec", "RequestStream"]
__all__ += ["StreamItem"]
logger = logging.getLogger(__name__)

# How long the idle thread waits for a command before looking around again (it wakes at once on one).
_IDLE_WAIT_S = 1.0


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
    """The engine is not running (never started, stopped, or died), so it takes no work."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.failure: BaseException | None = None
        self._core = EngineCore(engine, observe=metrics is not None)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched by the engine thread only
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
            while self._apply_commands(wait=not self._core.has_work):
                if self._core.has_work:
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
        deliveries = Deliveries()
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
        self._record_metrics()
        with self._lock:
            self._queued_sequences -= applied_sequences
            self._stats = self._core.snapshot()
        return True

    def _put_back(self, commands: list[_Command]) -> None:
        for command in commands:
            self._commands.put(command)

    def _apply(self, command: _Command, deliveries: Deliveries) -> None:
        if isinstance(command, _Add):
            answer = self._core.add(command.specs, command.arrival_time)
            if isinstance(answer, Accepted):
                self._streams.update((spec.request_id, command.stream) for spec in command.specs)
            deliveries.add(command.stream, answer)
        elif isinstance(command, _Abort):
            self._core.abort(command.request_ids)
            for request_id in command.request_ids:
                self._streams.pop(request_id, None)
        elif isinstance(command, _Call):
            _run_call(command, self.engine)

    def _step(self) -> None:
        outcome = self._core.step()
        deliveries = Deliveries()
        for delta in outcome.deltas:
            deliveries.add(self._streams[delta.request_id], delta)
        for request_id in outcome.done:
            del self._streams[request_id]
        if outcome.failure is not None:
            for request_id in outcome.failed:
                deliveries.add(self._streams.pop(request_id), outcome.failure)
        deliveries.send()
        self._record_metrics()

    def _record_metrics(self) -> None:
        observed = self._core.take_metrics()
        if self.metrics is not None:
            self.metrics.record(observed)

    def _shut_down(self, status_code: int, message: str) -> None:
        """Refuse new work, then answer everything in flight or still queued with ``status_code``."""
        with self._lock:
            self._accepting = False
        deliveries = Deliveries()
        for stream in self._streams.values():
            deliveries.add(stream, Failed(status_code, message))
        self._streams.clear()
        while not self._commands.empty():
            command = self._commands.get_nowait()
            if isinstance(command, _Add):
                deliveries.add(command.stream, Failed(status_code, message))
            elif isinstance(command, _Call):
                command.future.set_exception(EngineLoopStoppedError(message))
        deliveries.send()

    def _publish_stats(self) -> None:
        stats = self._core.snapshot()
        with self._lock:
            self._stats = stats


def _run_call(command: _Call, engine: LLMEngine) -> None:
    try:
        command.future.set_result(command.function(engine))
    except Exception as exc:
        command.future.set_exception(exc)
