"""Timing for the kernel explorations in this folder: calls captured in one CUDA graph, replayed back to
back, the mean GPU time of one call."""

from collections.abc import Callable, Sequence

import torch


def graph_micros(calls: Sequence[Callable[[], object]], repeats: int = 50) -> float:
    """Mean µs of one of ``calls`` (each run once on a side stream, then captured in order in one graph,
    the graph replayed ``repeats`` times after one warm replay)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeats * len(calls))
