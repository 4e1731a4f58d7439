"""The HTTP process's handle on the engine process: the same interface as ``EngineLoop`` (submit, abort,
stats, health), with a process boundary in place of a thread, so the engine's steps and the event loop
no longer share a GIL (vLLM v1 runs its engine core in its own process for the same reason).

``EngineClient.launch(config)`` spawns ``run_engine_process`` and waits until the engine is built; a
start-up failure (a bad model path, an unsupported architecture) raises ``EngineStartupError`` with the
engine's own message. Commands go down one pipe as they come; a reader thread takes each step's
``StepOutputs`` from the other and hands the deltas to the handlers' streams. If the process dies (killed,
out of memory, its loop broken), every request in flight or queued is answered with a 500 that says so,
new ones get a 503, and ``is_healthy`` turns False, as when the engine thread dies.
"""

import atexit
import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError
from tokenmill.server.engine_loop import EngineLoopStoppedError
from tokenmill.server.engine_messages import (
    AbortRequests,
    AddRequests,
    EngineCommand,
    EngineCrashed,
    EngineFacts,
    EngineReady,
    EngineStartupFailed,
    Failed,
    PromptSpec,
    Shutdown,
    StepOutputs,
    decode_delta,
)
from tokenmill.server.engine_process import run_engine_process
from tokenmill.server.metrics import EngineStats, ServerMetrics
from tokenmill.server.streams import Deliveries, RequestStream

logger = logging.getLogger(__name__)
_STARTUP_POLL_S = 0.2


class EngineStartupError(TokenmillError):
    """The engine process could not build the engine; the message is the engine's."""


class EngineProcessDiedError(TokenmillError):
    """The engine process ended while the server was running."""


@dataclass(frozen=True)
class _Pending:
    """An add sent to the engine, not yet answered."""

    stream: RequestStream
    request_ids: list[str]
    num_sequences: int


class EngineClient:
    def __init__(
        self, process: BaseProcess, commands: Connection, outputs: Connection, facts: EngineFacts
    ) -> None:
        self.facts = facts
        self.metrics: ServerMetrics | None = None  # fed with the engine's observations once set
        self.failure: BaseException | None = None
        self._process = process
        self._commands = commands
        self._outputs = outputs
        self._send_lock = threading.Lock()  # never held by the reader: a full pipe cannot deadlock it
        self._lock = threading.Lock()  # guards the fields below
        self._accepting = False
        self._stopping = False
        self._stats = EngineStats()
        self._pending: dict[int, _Pending] = {}
        self._streams: dict[str, RequestStream] = {}  # request id -> where its deltas go
        self._queued_sequences = 0
        self._add_ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="tokenmill-engine-reader", daemon=True)
        atexit.register(self.stop)  # before multiprocessing's own exit hook, which would wait on the child

    @classmethod
    def launch(cls, config: EngineConfig) -> "EngineClient":
        """Spawn the engine process and wait until its engine is built (model loaded, KV cache sized)."""
        context = multiprocessing.get_context("spawn")  # CUDA must be initialized in the child only
        commands_out, commands_in = context.Pipe(duplex=False)
        outputs_out, outputs_in = context.Pipe(duplex=False)
        process = context.Process(
            target=run_engine_process,
            args=(config, commands_out, outputs_in, os.getpid()),
            name="tokenmill-engine",
        )
        process.start()
        commands_out.close()  # the child's ends: closed here, so that its death reads as end of file
        outputs_in.close()
        try:
            facts = _wait_until_ready(process, outputs_out)
        except BaseException:  # Ctrl-C while loading too: the child ignores SIGINT
            _end(process, timeout_s=0.0)
            raise
        return cls(process, commands_in, outputs_out, facts)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # -- control ----------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            self._accepting = True
        self._reader.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process and wait for it; requests still in flight fail with a 503."""
        atexit.unregister(self.stop)
        with self._lock:
            self._stopping, self._accepting = True, False
        with contextlib.suppress(EngineLoopStoppedError):
            self._send(Shutdown())
        _end(self._process, timeout_s)
        if self._reader.is_alive():
            self._reader.join(timeout_s)
        else:
            self._fail_all(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        self._commands.close()

    @property
    def is_healthy(self) -> bool:
        return self._reader.is_alive() and self.failure is None

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
        add = AddRequests(next(self._add_ids), list(specs), time.monotonic())
        request_ids = [spec.request_id for spec in specs]
        with self._lock:
            if not self._accepting:
                raise EngineLoopStoppedError("the engine is not running")
            num_sequences = sum(spec.params.n for spec in specs)
            self._pending[add.add_id] = _Pending(stream, request_ids, num_sequences)
            self._queued_sequences += num_sequences
            self._streams.update((request_id, stream) for request_id in request_ids)
        self._send(add)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these engine requests; no more of their deltas are delivered. Unknown ids are ignored."""
        with self._lock:
            for request_id in request_ids:
                self._streams.pop(request_id, None)
        with contextlib.suppress(EngineLoopStoppedError):  # if nothing runs, there is nothing to abort
            self._send(AbortRequests(list(request_ids)))

    def _send(self, command: EngineCommand) -> None:
        with self._send_lock:
            try:
                self._commands.send(command)
            except OSError:  # BrokenPipeError, or closed by stop()
                raise EngineLoopStoppedError("the engine is not running") from None

    # -- the reader thread ------------------------------------------------------------------------

    def _read(self) -> None:
        crashed: EngineCrashed | None = None
        try:
            while True:
                message = self._outputs.recv()
                if isinstance(message, EngineCrashed):
                    crashed = message
                    break
                self._deliver(message)
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # a bug here must still answer everyone
            logger.exception("reading the engine's outputs failed")
            crashed = EngineCrashed(f"reading the engine's outputs failed: {exc!r}")
        self._ended(crashed)

    def _deliver(self, output: StepOutputs) -> None:
        deliveries = Deliveries()
        with self._lock:
            self._stats = output.stats
            for add_id, answer in output.added:
                pending = self._pending.pop(add_id)
                self._queued_sequences -= pending.num_sequences
                if isinstance(answer, Failed):
                    for request_id in pending.request_ids:
                        self._streams.pop(request_id, None)
                deliveries.add(pending.stream, answer)
            for values in output.deltas:
                stream = self._streams.get(values[0])  # the request id: None once aborted
                if stream is not None:
                    deliveries.add(stream, decode_delta(values))
            for request_id in output.done:
                self._streams.pop(request_id, None)
            if output.failed is not None:
                request_ids, failure = output.failed
                for request_id in request_ids:
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        deliveries.add(stream, failure)
        deliveries.send()
        if self.metrics is not None:
            self.metrics.record(output.metrics)

    def _ended(self, crashed: EngineCrashed | None) -> None:
        """The pipe closed: the process stopped as asked, or died. Answer everyone still waiting."""
        self._process.join(5.0)
        with self._lock:
            self._accepting = False
            stopping = self._stopping
        if stopping and crashed is None:
            self._fail_all(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
            return
        exit_code = self._process.exitcode
        reason = crashed.message if crashed else f"the engine process died (exit code {exit_code})"
        self.failure = EngineProcessDiedError(reason)
        logger.error("%s; failing the requests in flight", reason)
        self._fail_all(HTTPStatus.INTERNAL_SERVER_ERROR, reason)

    def _fail_all(self, status_code: int, message: str) -> None:
        deliveries = Deliveries()
        with self._lock:
            for pending in self._pending.values():
                deliveries.add(pending.stream, Failed(status_code, message))
            answered = {rid for pending in self._pending.values() for rid in pending.request_ids}
            for request_id, stream in self._streams.items():
                if request_id not in answered:
                    deliveries.add(stream, Failed(status_code, message))
            self._pending.clear()
            self._streams.clear()
            self._queued_sequences = 0
        deliveries.send()


def _wait_until_ready(process: BaseProcess, outputs: Connection) -> EngineFacts:
    while not outputs.poll(_STARTUP_POLL_S):
        if not process.is_alive():
            break
    try:
        message = outputs.recv() if outputs.poll() else None
    except EOFError:
        message = None
    if isinstance(message, EngineReady):
        return message.facts
    if isinstance(message, EngineStartupFailed):
        prefix = "" if message.bad_input else "the engine failed to start: "
        raise EngineStartupError(prefix + message.message)
    process.join(5.0)
    raise EngineStartupError(f"the engine process exited during start-up (exit code {process.exitcode})")


def _end(process: BaseProcess, timeout_s: float = 10.0) -> None:
    """Wait for the process to end, then terminate it, then kill it."""
    process.join(timeout_s)
    for stop in (process.terminate, process.kill):
        if process.exitcode is not None:
            return
        stop()
        process.join(2.0)
