"""The engine runs of ``bench tensor-parallel``, each in a fresh process: an engine at each tensor-parallel
size gets a clean GPU (its ranks, its KV pool, its process group and symmetric memory) and leaves nothing
behind for the next."""

import dataclasses
import gc
import logging
import multiprocessing
import queue
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from tokenmill.benchmarks.dummy_folder import write_folder
from tokenmill.benchmarks.kernel_profile import TraceSummary, summarize_trace
from tokenmill.benchmarks.latency import Latency, median_latency, tokenmill_once, weight_bytes_read_per_token
from tokenmill.benchmarks.measure import run_engine, warm_up_engine
from tokenmill.benchmarks.workload import DATASETS, WorkloadSpec, build_workload
from tokenmill.config import EngineConfig
from tokenmill.distributed import uses_custom_all_reduce, uses_push_all_reduce
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.profiling import profile_engine
from tokenmill.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)
SHUTDOWN_S = 30.0  # how long an engine's process may take to exit after sending its result


def in_fresh_process(function: Callable[..., None], *args: Any, timeout_s: float = 600.0) -> Any:
    """``function(*args)`` in a spawned process (not a daemon: it starts the workers of its engine). Its
    result is taken as soon as it is sent; the process then has a while to shut its engine down before it
    is killed (as it is after ``timeout_s`` without a result)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_call_and_put, args=(function, args, results), daemon=False)
    started = time.perf_counter()
    process.start()
    result = _wait_for_result(process, results, started + timeout_s)
    process.join(SHUTDOWN_S)
    if process.is_alive():
        logger.warning(
            "%s: its process did not exit %.0f s after its result; killed", function.__name__, SHUTDOWN_S
        )
        process.kill()  # its workers exit when their wait for rank 0's next step fails
        process.join()
    seconds = time.perf_counter() - started
    if result is None:
        raise RuntimeError(
            f"{function.__name__} failed after {seconds:.0f} s (exit code {process.exitcode}; its error, if "
            "any, is above)"
        )
    logger.info("%s done in %.0f s", function.__name__, seconds)
    return result


def _wait_for_result(process: Any, results: Any, deadline: float) -> Any:
    """The process's result, or None once it has died without one or the deadline has passed."""
    while time.perf_counter() < deadline:
        alive = process.is_alive()
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not alive:
                return None
    return None


def _call_and_put(function: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    log_with_times()
    function(*args, results.put)


def log_with_times() -> None:
    """INFO lines with wall-clock times (the engines' start-up lines among them), on stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(name)s: %(message)s")


def _with_engine(config: EngineConfig, use: Callable[[LLMEngine], T], send: Callable[[T], None]) -> None:
    """Build an engine, ``send`` what ``use`` makes of it, then shut it down."""
    engine = LLMEngine(config)
    try:
        send(use(engine))
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


# -- correctness ------------------------------------------------------------------------------------------


def greedy_tokens(
    config: EngineConfig, prompts: list[list[int]], max_tokens: int, send: Callable[[Any], None]
) -> None:
    """Every prompt's greedy tokens, the prompts batched together."""

    def generate(engine: LLMEngine) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs: dict[str, list[int]] = {str(index): [] for index in range(len(prompts))}
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                outputs[delta.request_id].extend(delta.new_token_ids)
        return [outputs[str(index)] for index in range(len(prompts))]

    _with_engine(config, generate, send)


def write_check_folder(preset: str, folder: Path, seed: int, send: Callable[[Any], None]) -> None:
    """The preset's dummy weights as a float32 HF folder, written once for every size to load."""
    write_folder(preset, folder, "float32", "cuda", seed)
    send(str(folder))


def random_prompts(
    vocab_size: int, count: int, seed: int, lengths: tuple[int, int] = (16, 64)
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)]


# -- batch-1 decode ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    latency: Latency
    weight_bytes_per_rank: int  # rank 0's shard, read once per decode step
    all_reduce: str  # the paths the all-reduces took, smallest messages first
    startup: str  # the engine's start-up line


def decode_latency(
    config: EngineConfig, input_len: int, output_len: int, iters: int, seed: int, send: Callable[[Any], None]
) -> None:
    def measure(engine: LLMEngine) -> DecodeRun:
        prompt = random_prompts(engine.model_config.vocab_size, 1, seed, (input_len, input_len))[0]
        latency = median_latency(lambda: tokenmill_once(engine, prompt, output_len), iters)
        weights = weight_bytes_read_per_token(engine.loaded.model)
        return DecodeRun(latency, weights, _all_reduce_paths(engine), engine.describe_startup())

    _with_engine(config, measure, send)


def _all_reduce_paths(engine: LLMEngine) -> str:
    if engine.workers is None:
        return "-"
    if not uses_custom_all_reduce():
        return "NCCL"
    return ("push + " if uses_push_all_reduce() else "") + "symmetric memory + NCCL"


# -- throughput -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ThroughputRun:
    output_tokens: int
    elapsed_s: float
    num_steps: int
    preemptions: int
    kv_pool_bytes: int  # rank 0's pool, sized by the memory profile of every rank
    startup: str

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def nano_vllm_spec(num_requests: int) -> WorkloadSpec:
    preset = DATASETS["nano-vllm"]
    lengths = preset.length_range
    return WorkloadSpec(num_requests, lengths, lengths, preset.seed, preset.ignore_eos, preset.prompt_source)


def throughput(config: EngineConfig, num_requests: int, send: Callable[[Any], None]) -> None:
    def measure(engine: LLMEngine) -> ThroughputRun:
        workload = build_workload(nano_vllm_spec(num_requests), None, engine.model_config.vocab_size)
        warm_up_engine(engine, workload)
        result = run_engine(engine, workload, f"TP={config.tensor_parallel_size}")
        preemptions = engine.scheduler_stats().num_preemptions
        pool = engine.kv_cache_memory().pool_bytes
        return ThroughputRun(
            result.num_output_tokens,
            result.elapsed_s,
            result.num_steps,
            preemptions,
            pool,
            engine.describe_startup(),
        )

    _with_engine(config, measure, send)


# -- kernel profile ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProfiledDecode:
    latency: Latency
    summaries: list[TraceSummary]  # rank 0's first
    traces: list[str]


def profiled_decode(
    config: EngineConfig,
    input_len: int,
    output_len: int,
    directory: Path,
    seed: int,
    send: Callable[[Any], None],
) -> None:
    """One batch-1 generation under the profiler on every rank, after one unprofiled to warm up."""

    def measure(engine: LLMEngine) -> ProfiledDecode:
        prompt = random_prompts(engine.model_config.vocab_size, 1, seed, (input_len, input_len))[0]
        tokenmill_once(engine, prompt, output_len)
        with profile_engine(engine, directory) as traces:
            latency = tokenmill_once(engine, prompt, output_len)
        summaries = [summarize_trace(path, rank) for rank, path in enumerate(traces)]
        return ProfiledDecode(latency, summaries, [str(path) for path in traces])

    _with_engine(config, measure, send)
