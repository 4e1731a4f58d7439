"""What the four tables share: the run's model and sizes, fixed-length workloads, one engine reused
over a table's rows, and the engine's config for each row."""

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tokenmill.benchmarks.measure import PeakMemory, synchronize
from tokenmill.benchmarks.seeds.sizes import SeedSizes
from tokenmill.benchmarks.workload import Workload, WorkloadSpec, build_workload
from tokenmill.cache import kv_bytes_per_token
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel
from tokenmill.sampling_params import SamplingParams

T = TypeVar("T")

WARMUP_TOKENS = 4


@dataclass(frozen=True)
class SeedSetup:
    """The model every table runs, the sizes, and the engine config every row starts from."""

    loaded: LoadedModel
    sizes: SeedSizes
    base: EngineConfig  # model, device, dtype, seed, max_model_len = sizes.context_len

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def kv_bytes_per_token(self) -> int:
        config = self.loaded.config
        return kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, self.loaded.dtype)

    def config(self, **options: Any) -> EngineConfig:
        return self.base.with_options(**options)


def base_config(
    loaded: LoadedModel, model: str, load_format: str, seed: int, context_len: int
) -> EngineConfig:
    return EngineConfig().with_options(
        model=model,
        device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        load_format=load_format,
        seed=seed,
        max_model_len=context_len,
    )


def fixed_workload(setup: SeedSetup, num_requests: int, input_len: int, output_len: int) -> Workload:
    """``num_requests`` random prompts of ``input_len`` tokens, each generating exactly ``output_len``."""
    spec = WorkloadSpec(num_requests, (input_len,) * 2, (output_len,) * 2, setup.base.seed, True, "random")
    return build_workload(spec, None, setup.loaded.config.vocab_size)


def run_on_engine(setup: SeedSetup, config: EngineConfig, measure: Callable[[LLMEngine], T]) -> T:
    """``measure`` run on an engine over the loaded weights, warmed up by one short request. The engine
    is referenced from here only, so its KV pool is freed before the next one sizes itself (a ``with``
    target in the caller's loop kept it alive through the release and the next engine's start)."""
    engine = LLMEngine(config, loaded=setup.loaded)
    try:
        warm_up(engine)
        return measure(engine)
    finally:
        del engine
        release_memory(setup.device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    engine.add_request("seeds-warmup", [1, 2, 3, 4, 5, 6, 7, 8], params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


@dataclass(frozen=True)
class BatchRun:
    """One workload served at once: what it produced, how long it took, and what it held at its peak."""

    num_requests: int
    output_tokens: int
    elapsed_s: float
    peak_kv_used_bytes: int  # KV blocks held by sequences, at the busiest step
    kv_pool_bytes: int  # the whole pool, allocated at start
    peak_memory_bytes: int  # torch's CUDA allocator peak; on CPU the process's resident-set peak
    peak_running: int  # sequences running at once, at most
    preemptions: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def serve_at_once(engine: LLMEngine, workload: Workload) -> BatchRun:
    """Add every request of ``workload``, step until all finish; count tokens, time, KV and memory. The
    prefix cache starts empty: rows reuse prompts, and a row must not find an earlier row's KV."""
    engine.reset_prefix_cache()
    memory = PeakMemory(engine.device)
    preempted_before = engine.scheduler_stats().num_preemptions
    synchronize(engine.device)
    memory.start()
    start = time.perf_counter()
    for request in workload.requests:
        engine.add_request(
            request.request_id, request.prompt_token_ids, workload.params_by_id[request.request_id]
        )
    tokens = peak_used = peak_running = 0
    while engine.has_unfinished_requests():
        peak_running = max(peak_running, engine.num_running)
        for delta in engine.step():
            tokens += len(delta.new_token_ids)
        peak_running = max(peak_running, engine.num_running)
        peak_used = max(peak_used, engine.kv_cache_memory().used_bytes)
        memory.sample()
    synchronize(engine.device)
    elapsed = time.perf_counter() - start
    preemptions = engine.scheduler_stats().num_preemptions - preempted_before
    pool = engine.kv_cache_memory().pool_bytes
    return BatchRun(
        workload.num_requests,
        tokens,
        elapsed,
        peak_used,
        pool,
        memory.peak_bytes(),
        peak_running,
        preemptions,
    )


def fastest_of(engine: LLMEngine, workload: Workload, repeats: int) -> BatchRun:
    """``serve_at_once`` ``repeats`` times; the fastest run (others on a shared machine only slow it down)."""
    runs = [serve_at_once(engine, workload) for _ in range(repeats)]
    return max(runs, key=lambda run: run.tokens_per_s)


def memory_measured(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated (weights, KV pool, activations)"
    return "the process's resident-set peak (VmHWM: weights, touched KV pages, activations, Python)"
