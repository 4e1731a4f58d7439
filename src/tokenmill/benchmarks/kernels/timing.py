"""Timing of a benchmarked call: ``do_bench`` medians on CUDA (wall clock elsewhere), replays from a CUDA
graph, and the host time per call of back-to-back eager calls."""

import statistics
import time
from collections.abc import Callable

import torch

HOST_TIMING_CALLS = 200


class Timer:
    def __init__(self, device: torch.device, warmup_ms: int, rep_ms: int) -> None:
        self.device, self.warmup_ms, self.rep_ms = device, warmup_ms, rep_ms

    def __call__(self, fn: Callable[[], object]) -> float:
        """Median seconds per call."""
        if self.device.type == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, self.warmup_ms, self.rep_ms, return_mode="median")) / 1e3
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def graphed(self, fn: Callable[[], object]) -> float | None:
        """Median seconds per replay of ``fn`` captured in a CUDA graph (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
            fn()
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as error:  # the call does something a graph cannot hold (a host copy...)
            print(f"    (not capturable: {str(error).splitlines()[0][:100]})", flush=True)
            return None
        seconds = self(graph.replay)
        del graph
        return seconds

    def host(self, fn: Callable[[], object], calls: int = HOST_TIMING_CALLS) -> float:
        """Host seconds per call of ``calls`` back-to-back calls (the device catches up afterwards)."""
        fn()
        self.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        seconds = (time.perf_counter() - start) / calls
        self.synchronize()
        return seconds

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def copy_bandwidth(timer: Timer, device: torch.device, num_bytes: int) -> float:
    """Bytes/s read + written by a device-to-device copy of ``num_bytes``."""
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = timer(lambda: target.copy_(source))
    return 2 * num_bytes / seconds
