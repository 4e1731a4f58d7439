"""Tensor parallelism on two GPUs (skipped with fewer): NCCL collectives and the symmetric-memory
all-reduces (torch's one-shot kernel and tokenmill's push kernel) captured inside CUDA graphs, each rank's
KV pool sized by its own memory profile, and the greedy tokens of one GPU."""

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tiny_models import save_tiny_model
from tokenmill.benchmarks.tensor_parallel.all_reduce import measure_collectives
from tokenmill.benchmarks.tensor_parallel.engines import in_fresh_process
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
PROMPTS = {f"r{i}": [(7 * i + j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(6)}


def _config(folder: Path, tp: int, **options: Any) -> EngineConfig:
    return EngineConfig(model=str(folder)).with_options(
        device="cuda", dtype="float32", tensor_parallel_size=tp, max_model_len=256, **options
    )


def _greedy(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {request_id: [] for request_id in PROMPTS}
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=12))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    return tokens


def _engines_in_one_process(configs: list[EngineConfig], send: Callable[[Any], None]) -> None:
    """Each config's engine in turn, in this (fresh) process: its greedy tokens and start-up line."""
    found = []
    for config in configs:
        engine = LLMEngine(config)
        try:
            found.append((_greedy(engine), engine.describe_startup()))
        finally:
            engine.shutdown()
            del engine
            gc.collect()  # the next engine sizes its pool from the memory this one leaves
    send(found)


def _run(*configs: EngineConfig) -> list[tuple[dict[str, list[int]], str]]:
    result: list[tuple[dict[str, list[int]], str]] = in_fresh_process(
        _engines_in_one_process, list(configs), timeout_s=300
    )
    return result


@pytest.mark.parametrize(("custom_all_reduce", "push"), [(None, None), (None, False), (False, None)])
def test_two_gpus_give_the_tokens_of_one(
    tmp_path: Path, custom_all_reduce: bool | None, push: bool | None
) -> None:
    """Every default on (CUDA graphs with the collectives captured, overlapped decode, the memory profile
    on every rank), with the push and symmetric-memory all-reduces (auto), symmetric memory without the
    push kernel, and NCCL alone; each engine in a fresh process."""
    save_tiny_model("llama3", tmp_path)
    [(one, _)] = _run(_config(tmp_path, 1))
    [(two, startup)] = _run(_config(tmp_path, 2, custom_all_reduce=custom_all_reduce, push_all_reduce=push))
    assert two == one
    assert ("symmetric memory" in startup) == (custom_all_reduce is None), startup
    assert ("push kernel" in startup) == (custom_all_reduce is None and push is None), startup
    assert "CUDA graphs" in startup, startup


def test_a_second_engine_of_a_process_falls_back_to_nccl(tmp_path: Path) -> None:
    """torch numbers symmetric-memory exchanges per process: a second tensor-parallel engine in the same
    process (its workers new) cannot set it up with them, so it uses NCCL, with the same tokens."""
    save_tiny_model("llama3", tmp_path)
    (first, first_startup), (second, second_startup) = _run(_config(tmp_path, 2), _config(tmp_path, 2))
    assert "push kernel" in first_startup, first_startup
    assert "all-reduces through the process group" in second_startup, second_startup
    assert second == first


def test_symmetric_all_reduces_sum_like_nccl() -> None:
    timings = measure_collectives(2, [8192, 64 * 1024, 512 * 1024, 2 * 2**20], 4096, torch.bfloat16)
    symmetric = [t for t in timings if t.path == "symmetric memory"]
    assert [t.nbytes for t in symmetric] == [8192, 64 * 1024, 512 * 1024]  # larger messages: NCCL
    push = [t for t in timings if t.path == "push"]
    assert [t.nbytes for t in push] == [8192, 64 * 1024]  # up to 64 KiB
    assert all(t.max_error == 0 for t in symmetric + push)
