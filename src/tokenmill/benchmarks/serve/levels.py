"""One concurrency level of ``bench serve``: a closed loop of at most ``concurrency`` streams in flight
(optionally Poisson arrivals), run by one client process or split over several.

One Python process parsing server-sent events tops out at a few thousand chunks per second, below what a
GPU server sends at high concurrency; past that the client, not the server, sets the pace (the server
then idles between requests). So a level's requests and its concurrency are dealt out round-robin to
``processes`` client processes that start together on the wall clock; the level lasts from that start to
the last one's end.
"""

import asyncio
import math
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

import httpx

from tokenmill.benchmarks.serve.client import BenchRequest, LevelResult, RequestRecord, Target, send_request

# Streams one client process handles before another one is worth starting.
STREAMS_PER_PROCESS = 16
START_MARGIN_S = 0.5  # for the worker processes to be ready when the level starts


def client_processes(concurrency: int, requested: int | None) -> int:
    """``requested``, or by default one process per 16 streams, at most half this machine's cores."""
    if requested is not None:
        return max(1, min(requested, concurrency))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores // 2, math.ceil(concurrency / STREAMS_PER_PROCESS)))


def arrival_offsets(count: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all at once, or Poisson at ``request_rate``."""
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


def run_level(
    target: Target,
    requests: Sequence[BenchRequest],
    concurrency: int,
    request_rate: float,
    seed: int,
    timeout_s: float,
    pool: ProcessPoolExecutor | None = None,
    processes: int = 1,
) -> LevelResult:
    offsets = arrival_offsets(len(requests), request_rate, seed)
    if pool is None or processes == 1:
        start_at = time.time()
        records, end = asyncio.run(
            _closed_loop(target, list(requests), offsets, concurrency, start_at, timeout_s)
        )
        return LevelResult(concurrency, end - start_at, records)
    start_at = time.time() + START_MARGIN_S
    futures = [
        pool.submit(
            _worker,
            target,
            list(requests[share::processes]),
            offsets[share::processes],
            len(range(share, concurrency, processes)),
            start_at,
            timeout_s,
        )
        for share in range(processes)
    ]
    results = [future.result() for future in futures]
    records = [record for share_records, _ in results for record in share_records]
    return LevelResult(concurrency, max(end for _, end in results) - start_at, records)


def _worker(
    target: Target,
    requests: list[BenchRequest],
    offsets: list[float],
    concurrency: int,
    start_at: float,
    timeout_s: float,
) -> tuple[list[RequestRecord], float]:
    return asyncio.run(_closed_loop(target, requests, offsets, concurrency, start_at, timeout_s))


async def _closed_loop(
    target: Target,
    requests: list[BenchRequest],
    offsets: list[float],
    concurrency: int,
    start_at: float,
    timeout_s: float,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` at ``start_at + offset`` (wall clock), at most ``concurrency`` in flight; the
    records and the wall-clock time the last one ended."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:

        async def one(request: BenchRequest, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start_at + offset - time.time()))
            async with semaphore:
                return await send_request(client, target, request.prompt, request.max_tokens)

        records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    return list(records), time.time()
