"""Rank 0's side of tensor parallelism: start the worker processes, announce each step to them, and
stop them, on shutdown or on any failure, so that none outlives the engine.

A failed worker surfaces as a failed collective on rank 0 (gloo and NCCL notice a closed connection, or
the collective times out); :meth:`WorkerGroup.guard` turns that into a :class:`TensorParallelError`
naming the rank that died, after stopping the others.
"""

import contextlib
import logging
import multiprocessing
import multiprocessing.process
import socket
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.distributed import destroy_tensor_parallel, init_tensor_parallel
from tokenmill.parallel.step_broadcast import StepSender
from tokenmill.parallel.worker import WorkerSpec, run_worker

logger = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 120.0  # a step's collectives; a dead peer is usually noticed long before
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # a worker waits this long for the next step of an idle engine
STARTUP_TIMEOUT_S = 300.0  # spawning a worker imports torch anew: seconds on a busy machine
_Process = multiprocessing.process.BaseProcess


class TensorParallelError(RuntimeError):
    """A worker process died or a collective failed; the engine cannot step any more."""


class WorkerGroup:
    """Ranks 1..N-1 as spawned processes, and rank 0 (this process) joined with them."""

    def __init__(self, config: EngineConfig, device: torch.device, timeout_s: float | None = None):
        timeout_s = timeout_s or COLLECTIVE_TIMEOUT_S
        self.world_size = world = config.tensor_parallel_size
        _check_devices(world, device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = dist.TCPStore("127.0.0.1", _free_port(), world, is_master=True, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        self.processes: dict[int, _Process] = {}
        for rank in range(1, world):
            worker_device = f"cuda:{(device.index or 0) + rank}" if device.type == "cuda" else "cpu"
            spec = WorkerSpec(
                rank,
                world,
                "127.0.0.1",
                store.port,
                backend,
                worker_device,
                config,
                timeout_s,
                IDLE_TIMEOUT_S,
            )
            process = context.Process(
                target=run_worker, args=(spec,), name=f"tokenmill-tp-{rank}", daemon=True
            )
            process.start()
            self.processes[rank] = process
        self._stop = weakref.finalize(self, _stop_processes, list(self.processes.values()))
        self._stopped_because = ""  # why, when a failure (not shutdown) stopped the workers
        self.sender = StepSender(device)
        with self.guard("start-up"):
            self._wait_for_workers(store, STARTUP_TIMEOUT_S)
            timeout = timedelta(seconds=timeout_s)
            init_tensor_parallel(backend, store, 0, world, timeout, timeout)  # rank 0 never idles in one
        self._store = store  # the store serves the group while it lives
        logger.info("tensor parallelism: %d ranks over %s (%s)", world, backend, device)

    def _wait_for_workers(self, store: dist.TCPStore, timeout_s: float) -> None:
        """Wait until every worker has reached the store, or fail at once when one has died."""
        keys = [f"joined/{rank}" for rank in self.processes]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            dead = self.dead_ranks()
            if dead:
                raise TensorParallelError(
                    f"{_describe_dead(dead)} while starting (its traceback is above; workers are spawned, "
                    "so a script that builds a tensor-parallel engine must do it under "
                    "`if __name__ == '__main__':`)"
                )
            if time.monotonic() > deadline:
                raise TensorParallelError(f"workers did not start within {timeout_s:.0f} s")
            time.sleep(0.05)

    def dead_ranks(self) -> dict[int, int | None]:
        """Rank -> exit code of each worker that is not running."""
        return {rank: p.exitcode for rank, p in self.processes.items() if not p.is_alive()}

    def raise_if_dead(self) -> None:
        dead = self.dead_ranks()
        if dead:
            raise TensorParallelError(_describe_dead(dead))

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run ``what`` (a step, start-up); on any failure stop every worker and raise a
        :class:`TensorParallelError` that names the dead rank, if one died."""
        if not self._stop.alive:
            raise TensorParallelError(f"the tensor-parallel workers have been stopped{self._stopped_because}")
        try:
            self.raise_if_dead()  # a worker that died between steps, before a collective notices
            yield
        except (KeyboardInterrupt, SystemExit) as interrupt:
            # Mid-step the ranks may be inside different collectives: none can be trusted to go on.
            name = type(interrupt).__name__
            self._stopped_because = f": a {what} was interrupted ({name}); build a new engine"
            self.shutdown(graceful=False)
            raise
        except Exception as error:
            dead = self._wait_for_exit(1.0) if isinstance(error, RuntimeError) else {}
            self.shutdown(graceful=False)
            if isinstance(error, TensorParallelError) or not (dead or _is_collective_error(error)):
                raise  # rank 0's own error (e.g. a bad config), not a failed rank or collective
            cause = _describe_dead(dead) if dead else f"a collective failed ({type(error).__name__}: {error})"
            raise TensorParallelError(f"tensor-parallel {what} failed: {cause}") from error

    def _wait_for_exit(self, seconds: float) -> dict[int, int | None]:
        """The dead ranks, waiting up to ``seconds`` for a dying one to be reaped."""
        deadline = time.monotonic() + seconds
        while not self.dead_ranks() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.dead_ranks()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (tell them first when ``graceful``) and leave the group; idempotent."""
        if not self._stop.alive:
            return
        if graceful and not self.dead_ranks():
            with contextlib.suppress(Exception):
                self.sender.shutdown()
            destroy_tensor_parallel()  # while the workers leave it too: NCCL's teardown waits for every rank
            for process in self.processes.values():
                process.join(timeout=5.0)
        self._stop()  # kills what is left: a worker may wait inside a collective that will never complete
        destroy_tensor_parallel(graceful=False)  # a no-op after the graceful one


def _stop_processes(processes: list[_Process]) -> None:
    """Kill the workers still running (also at interpreter exit, when no shutdown came first)."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5.0)


def _is_collective_error(error: Exception) -> bool:
    """Whether ``error`` came from a collective (gloo's errors are plain RuntimeErrors naming gloo)."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or "gloo" in text or "nccl" in text


def _describe_dead(dead: dict[int, int | None]) -> str:
    return "; ".join(f"worker rank {rank} exited (exit code {code})" for rank, code in sorted(dead.items()))


def _check_devices(world_size: int, device: torch.device) -> None:
    if device.type == "cuda":
        available = torch.cuda.device_count() - (device.index or 0)
        if world_size > available:
            raise ValueError(
                f"tensor_parallel_size {world_size} exceeds the {available} CUDA device(s) from {device} on"
            )
    elif device.type != "cpu":
        raise ValueError(f"tensor parallelism runs on cuda or cpu, not {device.type}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
