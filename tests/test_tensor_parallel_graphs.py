"""Graph runners and overlapped decode under tensor parallelism, on CPU (gloo, spawned workers).

Nothing is captured on CPU: rank 0 and every worker run the graph runners' static buffers eagerly, the
path a captured graph replays. ``ModelRunner.set_up_graphs`` is what a GPU engine calls at start-up; here
it is called after it, on CPU, and each worker builds its runners from the plan rank 0 sends. Each decode
step rank 0 runs over its buffers is announced with its arrays, each started (overlapped) step with its
arrays and the sampled token ids, so the workers replay the same step; the tokens must be those of one
rank, under continuous batching with arrivals, sequences ending at different lengths (started steps of
fewer rows), and preemption.
"""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tiny_models import save_tiny_model
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.runner.decode_inputs import DecodeInputs
from tokenmill.runner.graph_runners import GraphPlan
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams

# A pool small enough that four running sequences preempt each other.
POOL = {"num_kv_blocks": 14, "block_size": 4, "max_model_len": 32, "max_num_seqs": 4, "debug_checks": True}
# request id -> (step it arrives at, prompt, tokens to generate)
WORKLOAD = {
    "a": (0, [5, 6, 7, 8, 9], 14),
    "b": (1, [30, 31, 32], 7),
    "c": (1, [100, 7, 250, 3, 3, 9, 40, 41, 42], 12),
    "d": (2, [11, 12, 13, 14, 15, 16, 17], 14),
    "e": (9, [200, 201], 5),
    "f": (12, [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72], 9),
    "g": (14, [80, 81, 82, 83], 10),
}
PLAN = GraphPlan(decode_sizes=(1, 2, 4), prefill_sizes=(8, 16), logits_in_graph=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama 3 (4 heads, 2 KV heads) and a Llama of 6 heads sharing one KV head (fewer than the ranks)."""
    llama3 = tmp_path_factory.mktemp("llama3")
    save_tiny_model("llama3", llama3)
    one_kv = tmp_path_factory.mktemp("llama-6h-1kv")
    config = LlamaConfig(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(one_kv)
    return {"llama3": llama3, "llama-6h-1kv": one_kv}


def _engine(folder: Path, tp: int, **options: Any) -> LLMEngine:
    config = EngineConfig(model=str(folder)).with_options(device="cpu", tensor_parallel_size=tp, **POOL)
    return LLMEngine(config.with_options(**options))


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """Each model's tokens on one rank, every step eager (computed before any tensor-parallel engine
    starts: the process holds one group at a time)."""
    return {name: _run(_engine(folder, 1)) for name, folder in folders.items()}


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    """The workload's greedy tokens, each request added at its step, in one engine."""
    tokens: dict[str, list[int]] = {request_id: [] for request_id in WORKLOAD}
    step = 0
    while step <= max(arrival for arrival, _, _ in WORKLOAD.values()) or engine.has_unfinished_requests():
        for request_id, (arrival, prompt, max_tokens) in WORKLOAD.items():
            if arrival == step:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(request_id, prompt, params)
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
        step += 1
    assert [len(tokens[rid]) for rid in WORKLOAD] == [n for _, _, n in WORKLOAD.values()]
    assert engine.scheduler_stats().num_preemptions > 0, "the pool was meant to be small enough to preempt"
    return tokens


def _with_graphs(runner: ModelRunner, plan: GraphPlan) -> dict[str, list[int]]:
    """Rank 0's (and so every worker's) steps through static buffers at ``plan``'s sizes, overlapped;
    returns the sizes of the decode and prefill steps rank 0 runs through them, recorded as they run."""
    runner.set_up_graphs(plan)
    runner.overlap = True
    decode, prefill = runner.decode_graphs, runner.prefill_graphs
    assert decode is not None and prefill is not None
    runs: dict[str, list[int]] = {"decode": [], "prefill": []}
    decode_run, prefill_run = decode.run, prefill.run
    decode.run = lambda chunks: (runs["decode"].append(len(chunks)), decode_run(chunks))[1]  # type: ignore[method-assign]
    prefill.run = lambda chunk: (runs["prefill"].append(chunk.num_tokens), prefill_run(chunk))[1]  # type: ignore[method-assign]
    return runs


def _check_graph_steps(runner: ModelRunner, runs: dict[str, list[int]]) -> None:
    """Decode steps ran through the buffers, at every size, many of them started ahead (not while
    sequences wait: preemptions), some of those dropped (an arrival changed the batch), and a lone
    prefill went through its buffers too."""
    graphs = runner.decode_graphs
    assert graphs is not None
    assert len(runs["decode"]) > 15 and set(runs["decode"]) == {1, 2, 3, 4}
    assert 0 < graphs.num_reused < graphs.num_started <= len(runs["decode"])
    assert runs["prefill"] and max(runs["prefill"]) < 16


def test_two_ranks_through_static_buffers_and_overlap_match_one_rank(
    folders: dict[str, Path], references: dict[str, dict[str, list[int]]]
) -> None:
    """With the logits in the graph (every size here is at most 16 rows), then after the replay (each
    step's LM head is then a ``LOGITS`` message, its started steps' too), in one engine: the second plan
    replaces the first, on rank 0 and on the worker alike."""
    engine = _engine(folders["llama3"], 2)
    try:
        for logits_in_graph in (True, False):
            runs = _with_graphs(engine.runner, PLAN._replace(logits_in_graph=logits_in_graph))
            graphs = engine.runner.decode_graphs
            assert graphs is not None
            argmax_rows: list[int] = []
            argmax = graphs.argmax
            graphs.argmax = lambda logits, argmax=argmax, rows=argmax_rows: (
                rows.append(len(logits)),
                argmax(logits),
            )[1]
            assert _run(engine) == references["llama3"], logits_in_graph
            _check_graph_steps(engine.runner, runs)
            assert bool(argmax_rows) == logits_in_graph
    finally:
        engine.shutdown()


def test_three_ranks_sharing_one_kv_head_match_one_rank(
    folders: dict[str, Path], references: dict[str, dict[str, list[int]]]
) -> None:
    engine = _engine(folders["llama-6h-1kv"], 3)
    try:
        runs = _with_graphs(engine.runner, PLAN)
        assert _run(engine) == references["llama-6h-1kv"]
        _check_graph_steps(engine.runner, runs)
    finally:
        engine.shutdown()


def test_narrow_block_tables_are_widened_with_zeros() -> None:
    """What workers receive: block tables only as wide as the step's longest, written over rows that held
    wider ones (the staging buffers take turns: the third write reuses the first's)."""
    inputs = DecodeInputs(capacity=4, table_width=6, device=torch.device("cpu"))
    wide = np.arange(1, 25, dtype=np.int32).reshape(4, 6)
    inputs.write_arrays({"block_tables": wide}, 4)
    inputs.write_arrays({"block_tables": wide + 100}, 4)
    inputs.write_arrays({"block_tables": np.array([[7, 8], [9, 10], [0, 0]], np.int32)}, 3)
    assert inputs.views["block_tables"][:3].tolist() == [[7, 8, 0, 0, 0, 0], [9, 10, 0, 0, 0, 0], [0] * 6]
    assert inputs.views["block_tables"][3].tolist() == (wide[3] + 100).tolist()  # past the step's rows
