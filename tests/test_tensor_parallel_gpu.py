"""Tensor parallelism on two GPUs (skipped with fewer): NCCL collectives and the symmetric-memory
all-reduces (torch's one-shot kernel and tokenmill's push kernel) captured inside CUDA graphs, each rank's
KV pool sized by its own memory profile, and the greedy tokens of one GPU."""

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from tiny_models import save_tiny_model
from tokenmill.benchmarks.tensor_parallel.all_reduce import measure_collectives
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
PROMPTS = {f"r{i}": [(7 * i + j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(6)}


def _greedy(folder: Path, tp: int, **options: Any) -> tuple[dict[str, list[int]], str]:
    config = EngineConfig(model=str(folder)).with_options(
        device="cuda", dtype="float32", tensor_parallel_size=tp, max_model_len=256, **options
    )
    engine = LLMEngine(config)
    try:
        tokens: dict[str, list[int]] = {request_id: [] for request_id in PROMPTS}
        for request_id, prompt in PROMPTS.items():
            engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=12))
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id] += delta.new_token_ids
        return tokens, engine.describe_startup()
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # the next engine of this process sizes its pool from the memory this one leaves


@pytest.mark.parametrize(("custom_all_reduce", "push"), [(None, None), (None, False), (False, None)])
def test_two_gpus_give_the_tokens_of_one(
    tmp_path: Path, custom_all_reduce: bool | None, push: bool | None
) -> None:
    """Every default on (CUDA graphs with the collectives captured, overlapped decode, the memory profile
    on every rank), with the push and symmetric-memory all-reduces (auto), symmetric memory without the
    push kernel, and NCCL alone."""
    save_tiny_model("llama3", tmp_path)
    one, _ = _greedy(tmp_path, 1)
    two, startup = _greedy(tmp_path, 2, custom_all_reduce=custom_all_reduce, push_all_reduce=push)
    assert two == one
    assert ("symmetric memory" in startup) == (custom_all_reduce is None), startup
    assert ("push kernel" in startup) == (custom_all_reduce is None and push is None), startup
    assert "CUDA graphs" in startup, startup


def test_symmetric_all_reduces_sum_like_nccl() -> None:
    timings = measure_collectives(2, [8192, 64 * 1024, 512 * 1024, 2 * 2**20], 4096, torch.bfloat16)
    symmetric = [t for t in timings if t.path == "symmetric memory"]
    assert [t.nbytes for t in symmetric] == [8192, 64 * 1024, 512 * 1024]  # larger messages: NCCL
    push = [t for t in timings if t.path == "push"]
    assert [t.nbytes for t in push] == [8192, 64 * 1024]  # up to 64 KiB
    assert all(t.max_error == 0 for t in symmetric + push)
