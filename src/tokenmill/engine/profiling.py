"""Profile what an engine does inside a ``with`` block, on every rank (see :mod:`tokenmill.profiling`).

with profile_engine(engine, Path("traces")) as traces:
    engine.add_request(...); ...   # every step here is recorded
# traces: trace-rank0.json.gz, trace-rank1.json.gz, ... written
"""

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.parallel.launcher import WorkerGroup
from tokenmill.profiling import start_profiler, stop_profiler, trace_path


@contextlib.contextmanager
def profile_engine(engine: LLMEngine, directory: Path) -> Iterator[list[Path]]:
    """Record every rank from entry to exit; yields the paths of the traces written at exit (rank 0's
    first; the workers' are written before the block's exit returns)."""
    workers = engine.workers
    size = 1 if workers is None else workers.world_size
    _tell_workers(workers, True, directory)
    profiler = start_profiler(engine.device)
    try:
        yield [trace_path(directory, rank) for rank in range(size)]
    finally:
        stop_profiler(profiler, engine.device, directory, 0)
        _tell_workers(workers, False, directory)


def _tell_workers(workers: WorkerGroup | None, start: bool, directory: Path) -> None:
    if workers is not None:
        with workers.guard("profiling"):
            workers.sender.profile(start, str(directory))
