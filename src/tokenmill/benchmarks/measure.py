"""Running a workload through an engine and recording what happened: tokens, per-token times, memory.

``RunResult`` is the common record of every measured run, tokenmill's or the peer's, so comparisons
(token ids, tok/s, TPOT) are computed the same way for both.
"""

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from tokenmill.benchmarks.stats import mean, percentile
from tokenmill.benchmarks.workload import BenchRequest, Workload
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel
from tokenmill.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass
class RunResult:
    label: str
    output_token_ids: dict[str, list[int]]
    token_times: dict[str, list[float]]  # seconds since the run started, one per output token
    elapsed_s: float
    peak_kv_reserved_bytes: int | None = None
    kv_pool_bytes: int | None = None
    peak_memory_bytes: int | None = None
    num_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_token_ids.values())

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def requests_per_s(self) -> float:
        return len(self.output_token_ids) / self.elapsed_s

    def tpots(self) -> list[float]:
        """Per request: (last token time - first token time) / (output tokens - 1)."""
        return [
            (times[-1] - times[0]) / (len(times) - 1) for times in self.token_times.values() if len(times) > 1
        ]

    def tpot_mean_s(self) -> float:
        return mean(self.tpots())

    def tpot_p99_s(self) -> float:
        return percentile(self.tpots(), 99)


# -- memory -------------------------------------------------------------------------------------------


def _status_kib(key: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


class PeakMemory:
    """Peak process memory over a region: the CUDA allocator's peak, or the resident set's high-water mark.

    On Linux the kernel's VmHWM is reset at the start (``clear_refs`` 5), which catches short-lived peaks
    inside a forward pass; where that is not allowed the resident set is sampled at every ``sample()``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sampled = 0
        self._hwm_reset = False

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
            self._hwm_reset = True
        self._sampled = (_status_kib("VmRSS") or 0) * 1024

    def sample(self) -> None:
        if self.device.type != "cuda" and not self._hwm_reset:
            self._sampled = max(self._sampled, (_status_kib("VmRSS") or 0) * 1024)

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        self.sample()
        hwm = _status_kib("VmHWM") if self._hwm_reset else None
        return max(self._sampled, (hwm or 0) * 1024)


# -- running an engine --------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up_engine(engine: LLMEngine, workload: Workload, num_tokens: int = 4) -> None:
    """One short request first, so one-time costs (lazy init, allocator growth) stay out of the timing."""
    first = workload.requests[0]
    prompt = first.prompt_token_ids[: max(1, min(len(first.prompt_token_ids), 16))]
    engine.add_request("warmup", prompt, _params(workload, first, num_tokens))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()  # the measured requests find nothing of the warm-up cached


def _params(workload: Workload, request: BenchRequest, max_tokens: int | None = None) -> SamplingParams:
    params = workload.params_by_id[request.request_id]
    return params if max_tokens is None else replace(params, max_tokens=max_tokens)


def run_engine(
    engine: LLMEngine,
    workload: Workload,
    label: str,
    *,
    progress: Any = None,
) -> RunResult:
    """Serve every request of ``workload`` (added at its arrival time), recording each token's time.

    ``progress`` is anything with ``update(n)`` (a tqdm bar), advanced by output tokens.
    """
    memory = PeakMemory(engine.device)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in workload.requests}
    times: dict[str, list[float]] = {r.request_id: [] for r in workload.requests}
    pending = sorted(workload.requests, key=lambda r: r.arrival_time)
    peak_kv, steps = 0, 0
    synchronize(engine.device)
    memory.start()
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        pending = _add_arrived(engine, workload, pending, time.perf_counter() - start)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].arrival_time - (time.perf_counter() - start)))
            continue
        deltas = engine.step()
        now = time.perf_counter() - start
        steps += 1
        for delta in deltas:
            outputs[delta.request_id].extend(delta.new_token_ids)
            times[delta.request_id].extend([now] * len(delta.new_token_ids))
            if progress is not None:
                progress.update(len(delta.new_token_ids))
        peak_kv = max(peak_kv, engine.kv_cache_memory().used_bytes)
        memory.sample()
    synchronize(engine.device)
    elapsed = time.perf_counter() - start
    pool = engine.kv_cache_memory().pool_bytes
    return RunResult(label, outputs, times, elapsed, peak_kv, pool, memory.peak_bytes(), steps)


def _add_arrived(
    engine: LLMEngine, workload: Workload, pending: list[BenchRequest], now: float
) -> list[BenchRequest]:
    arrived = 0
    while arrived < len(pending) and pending[arrived].arrival_time <= now:
        request = pending[arrived]
        engine.add_request(request.request_id, request.prompt_token_ids, _params(workload, request))
        arrived += 1
    return pending[arrived:]


def on_fresh_engine(config: EngineConfig, loaded: LoadedModel, use: Callable[[LLMEngine], T]) -> T:
    """Build an engine over ``loaded``, ``use`` it (warm-up and measured run), then free its KV pool, so
    the next config measured in this process starts with the memory this one had."""
    engine = LLMEngine(config, loaded=loaded)
    try:
        return use(engine)
    finally:
        del engine
        gc.collect()
        if loaded.device.type == "cuda":
            torch.cuda.empty_cache()


def measure_engine(
    config: EngineConfig, loaded: LoadedModel, workload: Workload, label: str, show_progress: bool = True
) -> RunResult:
    """Build an engine over ``loaded``, warm it up, serve ``workload``, then free the engine's KV pool."""

    def serve(engine: LLMEngine) -> RunResult:
        warm_up_engine(engine, workload)
        with progress_bar(workload.max_output_tokens, label, show_progress) as bar:
            result = run_engine(engine, workload, label, progress=bar)
        result.extra["preemptions"] = engine.scheduler_stats().num_preemptions
        return result

    return on_fresh_engine(config, loaded, serve)


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool = True) -> Iterator[Any]:
    """A tqdm bar on stderr counting output tokens, or None when disabled or tqdm is missing."""
    if not enabled:
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    bar = tqdm(total=total, desc=description, unit="tok", leave=False, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


# -- correctness --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    request_id: str
    position: int  # first differing output index
    expected: list[int]
    got: list[int]

    def describe(self, context: int = 4) -> str:
        lo = max(0, self.position - context)
        hi = self.position + context + 1
        return (
            f"{self.request_id}: first difference at output token {self.position} "
            f"(expected {len(self.expected)} tokens, got {len(self.got)}): "
            f"expected ...{self.expected[lo:hi]} got ...{self.got[lo:hi]}"
        )


def compare_outputs(reference: RunResult, candidate: RunResult) -> list[Mismatch]:
    mismatches = []
    for request_id, expected in reference.output_token_ids.items():
        got = candidate.output_token_ids.get(request_id, [])
        if got != expected:
            position = next(
                (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                min(len(expected), len(got)),
            )
            mismatches.append(Mismatch(request_id, position, expected, got))
    return mismatches
