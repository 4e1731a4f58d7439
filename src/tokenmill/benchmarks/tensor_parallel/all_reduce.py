"""The latency of the collectives a tensor-parallel step makes, at the sizes it makes them: all-reduces of
the hidden rows (through NCCL, and through the symmetric-memory path of ``custom_all_reduce``) and the LM
head's all-gather of float32 logits, each timed eagerly and captured in a CUDA graph (how the engine runs
decode steps), on ``world_size`` spawned ranks, one per GPU. The symmetric-memory sums are checked
against NCCL's before they are timed."""

import dataclasses
import multiprocessing
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.benchmarks.stats import median
from tokenmill.distributed import all_gather_last_dim, destroy_tensor_parallel, init_tensor_parallel
from tokenmill.symmetric_all_reduce import create_symmetric_all_reduce

CALLS_PER_TIMING = 64  # collectives per timed span (about the two all-reduces of 32 layers of a step)
TIMINGS = 20
_TIMEOUT = timedelta(seconds=120)
Collective = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class CollectiveTiming:
    collective: str  # "all-reduce" or "all-gather"
    path: str  # "NCCL" or "symmetric memory"
    nbytes: int  # of each rank's input
    eager_us: float
    graph_us: float
    max_error: float | None  # all-reduce through symmetric memory: largest |difference| from NCCL's sum


def measure_collectives(
    world_size: int, all_reduce_bytes: list[int], all_gather_bytes: int, dtype: torch.dtype
) -> list[CollectiveTiming]:
    """Time every collective on ``world_size`` GPUs (spawned ranks; rank 0's timings are returned)."""
    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    spec = (world_size, port, all_reduce_bytes, all_gather_bytes, str(dtype).removeprefix("torch."))
    ranks = [context.Process(target=_rank_main, args=(rank, spec, results)) for rank in range(world_size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=600)
    failed = [rank for rank, process in enumerate(ranks) if process.exitcode != 0]
    if failed or results.empty():
        raise RuntimeError(f"the collective benchmark's rank(s) {failed} failed (their errors are above)")
    rows: list[dict[str, Any]] = results.get()
    return [CollectiveTiming(**row) for row in rows]


def _rank_main(rank: int, spec: tuple[int, int, list[int], int, str], results: Any) -> None:
    world_size, port, all_reduce_bytes, all_gather_bytes, dtype_name = spec
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=_TIMEOUT)
    init_tensor_parallel("nccl", store, rank, world_size, _TIMEOUT, _TIMEOUT)
    try:
        dist.all_reduce(torch.ones(1, device=device))  # the communicator, before anything is captured
        group = dist.group.WORLD
        assert group is not None
        symmetric = create_symmetric_all_reduce(group, device, False, dtype, push=True, pdl=False)
        rows = []
        for nbytes in all_reduce_bytes:
            x = _random_rows(nbytes, dtype, device, seed=rank)
            rows.append(_timing("all-reduce", "NCCL", x.clone(), _nccl_all_reduce, None))
            if symmetric is None or not symmetric.fits(x):
                continue
            reference = _nccl_all_reduce(x.clone())
            paths = [("symmetric memory", symmetric.one_shot)]
            if x.numel() <= symmetric.push_capacity:
                paths.append(("push", symmetric.push))
            for path, run in paths:
                error = (run(x).float() - reference.float()).abs().max().item()
                rows.append(_timing("all-reduce", path, x, run, error))
        logits = _random_rows(all_gather_bytes, torch.float32, device, seed=rank)
        gather = _timing("all-gather", "NCCL", logits, lambda t: all_gather_last_dim(t, world_size), None)
        rows.append(gather)
        if rank == 0:
            results.put([dataclasses.asdict(row) for row in rows])
    finally:
        destroy_tensor_parallel()


def _random_rows(nbytes: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    numel = nbytes // dtype.itemsize
    return torch.randn(1, numel, generator=generator, device=device).to(dtype)


def _nccl_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)  # in place; the timed loops let the sums grow (NCCL's time does not depend on them)
    return x


def _timing(
    collective: str, path: str, x: torch.Tensor, run: Collective, error: float | None
) -> CollectiveTiming:
    nbytes = x.numel() * x.element_size()
    eager = _median_us(lambda: _calls(run, x), x.device)
    graph = torch.cuda.CUDAGraph()
    _calls(run, x)  # warm-up outside the capture (NCCL and the allocator set up their buffers)
    torch.cuda.synchronize(x.device)
    with torch.cuda.graph(graph):
        _calls(run, x)
    graph_us = _median_us(graph.replay, x.device)
    return CollectiveTiming(collective, path, nbytes, eager, graph_us, error)


def _calls(run: Collective, x: torch.Tensor) -> None:
    for _ in range(CALLS_PER_TIMING):
        run(x)


def _median_us(span: Callable[[], None], device: torch.device) -> float:
    """Median time of one collective over ``TIMINGS`` spans of ``CALLS_PER_TIMING`` (device events)."""
    span()
    times = []
    for _ in range(TIMINGS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        span()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_TIMING)
    return median(times)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
