"""The engine's own process (the default way of serving): the model, scheduler, KV cache, sampler,
grammar matchers and detokenizer live here, so the engine's steps never wait for the HTTP process's GIL.

``run_engine_process`` is the child's entry point (started with the spawn method by ``EngineClient``:
CUDA is initialized here only). It builds the engine, sends ``EngineReady`` (or ``EngineStartupFailed``
with the error's message), then loops: apply every command waiting in the pipe, step the engine if any
request is in flight, and send one ``StepOutputs`` with every delta of the step. It exits on
``Shutdown``, and on its own when the HTTP process is gone (the command pipe's end of file, or a new
parent pid): never an orphan holding the GPU. It ignores SIGINT, which a terminal sends to the whole
process group: Ctrl-C is the HTTP process's to handle, and it stops this one through the pipe.
"""

import logging
import os
import signal
from multiprocessing.connection import Connection

from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError
from tokenmill.server.engine_core import EngineCore, engine_facts
from tokenmill.server.engine_messages import (
    AbortRequests,
    AddRequests,
    EngineCommand,
    EngineCrashed,
    EngineReady,
    EngineStartupFailed,
    Shutdown,
    StepOutputs,
    encode_delta,
)

logger = logging.getLogger(__name__)

# How long an idle engine waits for a command before checking that its parent is still there.
_IDLE_WAIT_S = 1.0


class _ParentGoneError(Exception):
    pass


def run_engine_process(config: EngineConfig, commands: Connection, outputs: Connection, parent: int) -> None:
    """Build the engine and serve commands until told to stop or orphaned; ``parent``: the HTTP
    process's pid."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from tokenmill.engine.llm_engine import LLMEngine  # torch and CUDA: in this process only

    _leave_a_core_to_the_http_process(config)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        bad_input = isinstance(exc, TokenmillError | ValueError)
        if not bad_input:
            logger.exception("the engine failed to start")
        outputs.send(EngineStartupFailed(str(exc) if bad_input else repr(exc), bad_input))
        return
    try:
        outputs.send(EngineReady(engine_facts(engine)))
        _serve(EngineCore(engine), commands, outputs, parent)
    except (_ParentGoneError, EOFError, BrokenPipeError):
        pass  # the HTTP process is gone: nobody to answer
    except BaseException as exc:
        logger.exception("the engine process's loop died")
        outputs.send(EngineCrashed(f"the engine loop died: {exc!r}"))
        raise SystemExit(1) from None  # after the finally below: a non-zero exit code for the parent
    finally:
        engine.shutdown()


def _leave_a_core_to_the_http_process(config: EngineConfig) -> None:
    """On the CPU, torch's threads take every core but one (unless OMP_NUM_THREADS says otherwise).

    With all of them, its OpenMP threads spin at their barriers while the HTTP process holds a core: on 2
    cores the server ran ~5x slower than with one torch thread (tiny dummy Llama, 64 streams)."""
    import torch

    from tokenmill.engine.hardware_defaults import resolve_device

    if resolve_device(config.device).type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))


def _serve(core: EngineCore, commands: Connection, outputs: Connection, parent: int) -> None:
    while True:
        received = _receive(commands, wait=not core.has_work, parent=parent)
        output = StepOutputs()
        for command in received:
            if isinstance(command, Shutdown):
                return
            _apply(core, command, output)
        if core.has_work:
            _step(core, output)
        if received or core.has_work or output.deltas or output.failed:
            output.stats, output.metrics = core.snapshot(), core.take_metrics()
            outputs.send(output)


def _receive(commands: Connection, wait: bool, parent: int) -> list[EngineCommand]:
    """Every command waiting; ``wait``: block (a while) for the first one."""
    if wait and not commands.poll(_IDLE_WAIT_S) and os.getppid() != parent:
        raise _ParentGoneError()
    received: list[EngineCommand] = []
    while commands.poll():
        received.append(commands.recv())  # EOFError once the HTTP process has closed its end
    return received


def _apply(core: EngineCore, command: EngineCommand, output: StepOutputs) -> None:
    if isinstance(command, AddRequests):
        output.added.append((command.add_id, core.add(command.specs, command.arrival_time)))
    elif isinstance(command, AbortRequests):
        core.abort(command.request_ids)


def _step(core: EngineCore, output: StepOutputs) -> None:
    outcome = core.step()
    output.deltas = [encode_delta(delta) for delta in outcome.deltas]
    output.done = outcome.done
    if outcome.failure is not None:
        output.failed = (outcome.failed, outcome.failure)
