"""The torch profiler over a stretch of engine work, on every rank of the engine.

Each rank records its own host calls and GPU kernels (those replayed from CUDA graphs included) and writes
one Chrome trace, ``trace-rank<r>.json.gz``, which chrome://tracing and Perfetto open and
:mod:`tokenmill.benchmarks.kernel_profile` sums up. Rank 0 starts and stops its workers' profilers
through the step broadcast (``Command.PROFILE``); :func:`tokenmill.engine.profiling.profile_engine` is
the entry point.
"""

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def trace_path(directory: Path, rank: int) -> Path:
    return directory / f"trace-rank{rank}.json.gz"


def start_profiler(device: torch.device) -> profile:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def stop_profiler(profiler: profile, device: torch.device, directory: Path, rank: int) -> Path:
    """Stop once the device has run everything queued (kernels still queued would go unrecorded), then
    write the rank's trace."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.stop()
    directory.mkdir(parents=True, exist_ok=True)
    path = trace_path(directory, rank)
    profiler.export_chrome_trace(str(path))  # gzipped: the name ends in .gz
    return path
