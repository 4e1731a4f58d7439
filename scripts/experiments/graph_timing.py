"""Timing for the kernel explorations in this folder: a CUDA graph replayed back to back, and calls
captured in one graph for that."""

from collections.abc import Callable, Sequence

import torch


def graph_micros(calls: Sequence[Callable[[], object]], repeats: int = 50) -> float:
    """Mean µs of one of ``calls`` (each run once on a side stream, then captured in order in one graph,
    the graph replayed ``repeats`` times back to back)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return replay_micros(graph, repeats) / len(calls)


def replay_micros(graph: torch.cuda.CUDAGraph, replays: int = 200) -> float:
    """GPU µs per replay of ``graph``, ``replays`` back to back after 10 warm-up replays."""
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / replays * 1e3
