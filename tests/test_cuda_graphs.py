"""Decode graphs, step inputs and KV sizing, on CPU: everything around the capture itself.

The capture and replay need a GPU (``scripts/gpu_engine_check.py``); here the graph runner runs the
same computation eagerly over the same static, padded buffers, and the engine's tokens are checked
against the single-sequence reference loop. KV sizing runs against a fake device-memory reader.
"""

import logging
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from engine_helpers import engine_for, run_to_completion
from tokenmill import SamplingParams
from tokenmill.cache.kv_pool import (
    DeviceMemory,
    kv_budget_bytes,
    kv_bytes_per_block,
    num_blocks_for_device_memory,
)
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import load_model
from tokenmill.reference import greedy_generate
from tokenmill.runner import cuda_graphs as cuda_graphs_module
from tokenmill.runner import kv_cache as kv_cache_module
from tokenmill.runner.cuda_graphs import (
    DecodeGraphRunner,
    DecodeInputs,
    DecodeRow,
    cuda_graph_batch_sizes,
    cuda_graph_sizes,
    is_decode_step,
    padded_batch_size,
)
from tokenmill.runner.step_inputs import PackedLayout, pack_to_device

GIB = 2**30
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_llama_folder):  # type: ignore[no-untyped-def]
    return load_model(tiny_llama_folder, dtype="float32")


# -- sizes and toggles -----------------------------------------------------------------------------------


def test_capture_sizes_and_padding() -> None:
    assert cuda_graph_batch_sizes(1) == (1,)
    assert cuda_graph_batch_sizes(3) == (1, 2, 3)
    assert cuda_graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = cuda_graph_batch_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24) and sizes[-1] == 256 and len(sizes) == 35
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 9, 17, 255, 256, 257)] == [
        1, 4, 8, 16, 24, 256, 256, None,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least 1"):
        cuda_graph_batch_sizes(0)


def test_cuda_graph_toggles_are_validated() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig.cuda_graphs must be off unless attention_backend"):
        EngineConfig(cuda_graphs=True)
    with pytest.raises(ValueError, match=r"EngineConfig.cuda_graphs must be off when kv_cache is 'none'"):
        EngineConfig(cuda_graphs=True, attention_backend="triton", kv_cache="none")
    with pytest.raises(ValueError, match=r"EngineConfig.cuda_graph_max_batch_size must be at least 1"):
        EngineConfig(cuda_graph_max_batch_size=0)
    config = EngineConfig(cuda_graphs=True, attention_backend="triton", max_num_seqs=20)
    assert cuda_graph_sizes(config, torch.device("cuda")) == (1, 2, 4, 8, 16, 20)
    capped = EngineConfig(cuda_graphs=True, attention_backend="triton", cuda_graph_max_batch_size=4)
    assert cuda_graph_sizes(capped, torch.device("cuda")) == (1, 2, 4)
    assert cuda_graph_sizes(EngineConfig(), torch.device("cuda")) == ()
    assert cuda_graph_sizes(config, CPU) == ()  # ignored on CPU


# -- step inputs -------------------------------------------------------------------------------------------


def test_packed_inputs_keep_values_shapes_and_alignment() -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "a": rng.integers(-5, 1 << 40, 7, dtype=np.int64),
        "b": rng.integers(-5, 1000, (3, 5), dtype=np.int32),
        "empty": np.zeros(0, np.int64),
        "c": rng.integers(-5, 1000, 3, dtype=np.int32),
    }
    out = pack_to_device(arrays, CPU)
    for name, array in arrays.items():
        assert out[name].dtype == torch.from_numpy(array).dtype
        assert np.array_equal(out[name].numpy(), array), name
    layout = PackedLayout([("x", torch.int32, 3), ("y", torch.int64, 1)])
    assert layout.fields["y"].offset == 16 and layout.nbytes == 32
    assert layout.prefix_bytes("y", 1) == 24


def _decode_chunks(engine: LLMEngine, prompts: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    engine.step()  # the prefills
    chunks = engine.scheduler.schedule().chunks
    assert is_decode_step(chunks)
    return chunks


def test_static_decode_inputs_equal_the_eager_preparation(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, block_size=4, num_kv_blocks=64, max_model_len=64)
    chunks = _decode_chunks(engine, [list(range(10, 12)), list(range(20, 29)), list(range(40, 45))])
    manager = engine.kv_cache.manager
    eager = engine.runner.prepare(chunks)
    inputs = DecodeInputs(capacity=8, table_width=16, device=CPU)
    inputs.write([DecodeRow(c.request, c.start) for c in chunks], manager, num_rows=4)
    count = len(chunks)
    assert torch.equal(inputs.input_ids[:count], eager.input_ids)
    assert torch.equal(inputs.positions[:count], eager.positions)
    assert torch.equal(inputs.slot_mapping[:count], eager.metadata.slot_mapping)
    assert torch.equal(inputs.seq_lens[:count], eager.metadata.seq_lens)
    expected_slots = [manager.slot(c.request.request_id, c.start) for c in chunks]  # independent of both
    assert inputs.slot_mapping[:count].tolist() == expected_slots
    eager_tables = eager.metadata.block_tables
    assert torch.equal(inputs.block_tables[:count, : eager_tables.shape[1]], eager_tables)
    assert not inputs.block_tables[:count, eager_tables.shape[1] :].any()
    # Row 3 pads the batch to 4: it writes nowhere and reads one token of block 0.
    assert inputs.input_ids[3] == 0 and inputs.positions[3] == 0
    assert inputs.slot_mapping[3:].eq(-1).all() and inputs.seq_lens[3:].eq(1).all()
    assert not inputs.block_tables[3].any()
    metadata = inputs.metadata(4, 64)
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert metadata.max_query_len == 1 and metadata.max_seq_len == 64 and metadata.num_seqs == 4
    # A smaller batch afterwards: its padding rows are rewritten, whatever the last step left there.
    inputs.write([DecodeRow(chunks[0].request, chunks[0].start)], manager, num_rows=2)
    assert inputs.slot_mapping[1:].eq(-1).all() and inputs.input_ids[1:].eq(0).all()
    assert inputs.block_tables[1, 0] == 0
    # Token ids given on the device replace the requests' own (the overlapped next step's inputs).
    rows = [DecodeRow(c.request, c.start + 1) for c in chunks]
    inputs.write(rows, manager, num_rows=4, token_ids=torch.tensor([7, 8, 9]))
    assert inputs.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert inputs.positions[:3].tolist() == [c.start + 1 for c in chunks]
    assert inputs.slot_mapping[:3].tolist() == [
        manager.slot(c.request.request_id, c.start + 1) for c in chunks
    ]


def _with_static_decode(
    engine: LLMEngine,
    sizes: tuple[int, ...],
    overlap: bool = False,
    waiting: bool | None = None,
    logits_in_graph: bool = False,
) -> list[int]:
    """Route the engine's decode steps through a graph runner that runs eagerly (no capture on CPU);
    returns a list that records the batch size of each step it ran. ``waiting`` overrides the hint
    that requests wait for admission (False: overlap even when the next step will differ)."""
    kv = engine.kv_cache
    hint = (lambda: bool(engine.scheduler.waiting)) if waiting is None else (lambda: waiting)
    runner = DecodeGraphRunner(
        engine.runner.model, engine.runner.backend, kv.layers, kv.manager, sizes, engine.max_model_len, CPU,
        overlap, hint, logits_in_graph, engine.runner.sampler.argmax,
    )  # fmt: skip
    engine.runner.decode_graphs = runner
    return _count_runs(runner)


def _count_runs(runner: DecodeGraphRunner) -> list[int]:
    """The batch size of every step ``runner`` runs, recorded as they run."""
    calls: list[int] = []
    run = runner.run

    def counted(chunks: Any) -> torch.Tensor:
        calls.append(len(chunks))
        return run(chunks)

    runner.run = counted  # type: ignore[method-assign]
    return calls


def _check_against_reference(tiny, engine: LLMEngine, calls: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Five requests of different lengths: the batch shrinks from 5 (above the largest size: eager) to
    4, 3 (padded to 4), 2 and 1."""
    prompts = {f"r{i}": list(range(3 + 7 * i, 3 + 7 * i + 2 + 5 * i)) for i in range(5)}
    max_tokens = {rid: 3 + 2 * i for i, rid in enumerate(prompts)}
    requests = {
        rid: (prompt, SamplingParams(temperature=0, max_tokens=max_tokens[rid], ignore_eos=True))
        for rid, prompt in prompts.items()
    }
    outputs = run_to_completion(engine, requests)
    for rid, prompt in prompts.items():
        expected = greedy_generate(tiny.model, prompt, max_tokens[rid]).token_ids
        assert outputs[rid].outputs[0].token_ids == expected, rid
    assert set(calls) == {1, 2, 3, 4}, calls  # batch 5 ran eagerly
    assert engine.kv_cache.manager.num_used_blocks == 0


@pytest.mark.parametrize("logits_in_graph", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_decode_through_static_buffers_matches_the_reference_loop(
    tiny, overlap: bool, logits_in_graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """With ``logits_in_graph``, steps of up to 2 rows compute their logits and argmax in the graph, the
    padded steps of 4 after it."""
    monkeypatch.setattr(cuda_graphs_module, "GRAPH_LOGITS_MAX_ROWS", 2)
    engine = engine_for(tiny, block_size=4, num_kv_blocks=64, max_model_len=64)
    calls = _with_static_decode(engine, (1, 2, 4), overlap, logits_in_graph=logits_in_graph)
    graphs = engine.runner.decode_graphs
    argmax_rows: list[int] = []
    argmax = graphs.argmax
    graphs.argmax = lambda logits: argmax_rows.append(len(logits)) or argmax(logits)
    _check_against_reference(tiny, engine, calls)
    assert set(argmax_rows) == ({1, 2} if logits_in_graph else set())
    if overlap:  # next steps were started and used, but not where a sequence crosses a block or ends
        assert 0 < graphs.num_reused <= graphs.num_started < len(calls)
    else:
        assert graphs.num_started == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_overlapped_decode_survives_arrivals_aborts_and_preemption(
    tiny, seed: int, prefix_caching: bool
) -> None:  # type: ignore[no-untyped-def]
    """Next steps are started even when requests wait (the hint forced off), so many are dropped: on
    arrivals, aborts, finishes and preemptions; started steps take blocks ahead of the scheduler. Nothing
    may change any output, or leave the allocator and prefix tree inconsistent (checked every step)."""
    rng = random.Random(seed)
    engine = engine_for(
        tiny, block_size=4, num_kv_blocks=16, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=64,
        prefix_caching=prefix_caching, debug_checks=True,
    )  # fmt: skip
    graphs_calls = _with_static_decode(engine, (1, 2, 4, 6), overlap=True, waiting=False)
    shared = [rng.randrange(3, 384) for _ in range(9)]  # a prefix some prompts share
    workload = {
        f"r{i}": (
            (shared if i % 3 == 0 else []) + [rng.randrange(3, 384) for _ in range(rng.randint(1, 14))],
            rng.randint(1, 20),
        )
        for i in range(12)
    }
    arrivals = sorted(workload, key=lambda _: rng.random())
    doomed = set(rng.sample(sorted(workload), 2))  # aborted after a few tokens
    texts: dict[str, list[int]] = {rid: [] for rid in workload}
    while arrivals or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if arrivals:
                rid = arrivals.pop()
                prompt, max_tokens = workload[rid]
                engine.add_request(
                    rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                )
        for delta in engine.step():
            texts[delta.request_id] += delta.new_token_ids
        for rid in doomed:
            if len(texts[rid]) >= 2 and rid in engine.requests:
                engine.abort(rid)
    graphs = engine.runner.decode_graphs
    assert graphs_calls and graphs.num_started >= graphs.num_reused > 0
    assert engine.scheduler_stats().num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert engine.kv_cache.manager.num_used_blocks == 0
    for rid, (prompt, max_tokens) in workload.items():
        expected = greedy_generate(tiny.model, prompt, max_tokens).token_ids
        if rid in doomed:
            assert texts[rid] == expected[: len(texts[rid])], rid
        else:
            assert texts[rid] == expected, rid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing CUDA graphs needs a GPU")
@pytest.mark.parametrize("overlap", [False, True])
def test_captured_graphs_match_the_reference_loop(tiny_llama_folder, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    loaded = load_model(tiny_llama_folder, device="cuda", dtype="float32")
    engine = engine_for(
        loaded, device="cuda", attention_backend="triton", cuda_graphs=True, overlap_decode=overlap,
        cuda_graph_max_batch_size=4, block_size=4, num_kv_blocks=64, max_model_len=64,
    )  # fmt: skip
    graphs = engine.runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
    _check_against_reference(loaded, engine, _count_runs(graphs))
    assert (graphs.num_reused > 0) == overlap


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs a Hopper (or later) GPU",
)
def test_programmatic_launch_changes_no_token_or_logprob(tiny_llama_folder) -> None:  # type: ignore[no-untyped-def]
    """In bfloat16 the GEMVs (batch 1) and every other kernel of the decode graphs run with and without
    PDL: the same greedy tokens and bit-identical logprobs, alone and batched."""
    loaded = load_model(tiny_llama_folder, device="cuda", dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = {"a": [4, 8, 15, 16, 23], "b": [42, 7], "c": [3, 1, 4, 1, 5, 9, 2, 6]}
    results = []
    for pdl in (False, True):
        engine = engine_for(
            loaded, device="cuda", attention_backend="triton", cuda_graphs=True, overlap_decode=True,
            cuda_graph_max_batch_size=4, block_size=4, num_kv_blocks=64, max_model_len=64,
            programmatic_launch=pdl,
        )  # fmt: skip
        assert loaded.model.kernel_options.pdl == pdl and loaded.model.kernel_options.gemv
        alone = run_to_completion(engine, {"alone": (prompts["a"], params)})
        batched = run_to_completion(engine, {name: (ids, params) for name, ids in prompts.items()})
        results.append(
            {
                name: (out.outputs[0].token_ids, out.outputs[0].logprobs)
                for name, out in {**alone, **batched}.items()
            }
        )
    assert results[0] == results[1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's CPU interpreter")
@pytest.mark.parametrize("fused", [False, True])
def test_triton_decode_with_a_fixed_split_bound_matches_the_reference_loop(tiny, fused: bool) -> None:  # type: ignore[no-untyped-def]
    """Graphs bound the context by max_model_len, so split-K runs partitions past the end of each
    sequence (4 of 16 keys here, where the eager step needs 1 or 2): they must add nothing. Padded rows
    (slot -1) must write nothing when the decode kernel stores the new K/V itself (``fused``)."""
    pytest.importorskip("triton")
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.kernels.attention import DecodeConfig

    engine = engine_for(tiny, attention_backend="triton", block_size=4, num_kv_blocks=64, max_model_len=64)
    config = DecodeConfig(block_n=16, num_warps=4, num_stages=1)
    engine.runner.backend = TritonAttentionBackend(16, config, fused_decode_rotary_kv=fused)
    _check_against_reference(tiny, engine, _with_static_decode(engine, (1, 2, 4)))


def test_a_started_step_is_dropped_when_the_batch_changes(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, block_size=4, num_kv_blocks=64, max_model_len=64)
    _with_static_decode(engine, (1, 2, 4), overlap=True, waiting=False)
    graphs = engine.runner.decode_graphs
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {"a": [5, 6, 7], "b": list(range(30, 41)), "c": [9, 8, 7, 6]}
    texts: dict[str, list[int]] = {rid: [] for rid in prompts}

    def step() -> None:
        for delta in engine.step():
            texts[delta.request_id] += delta.new_token_ids

    engine.add_request("a", prompts["a"], params)
    engine.add_request("b", prompts["b"], params)
    for _ in range(3):
        step()
    assert graphs.num_reused == 1 and graphs._started is not None  # a step has been started again
    engine.abort("b")  # the started step holds b: it is dropped
    step()
    assert (graphs.num_started, graphs.num_reused) == (3, 1)
    step()
    engine.add_request("c", prompts["c"], params)  # a prefill joins: the started step is dropped
    while engine.has_unfinished_requests():
        step()
    assert graphs.num_started - graphs.num_reused == 2
    for rid in ("a", "c"):
        assert texts[rid] == greedy_generate(tiny.model, prompts[rid], 12).token_ids, rid
    assert texts["b"] == greedy_generate(tiny.model, prompts["b"], 12).token_ids[: len(texts["b"])]


def test_profile_forward_runs_the_largest_step(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, block_size=4, num_kv_blocks=8, max_model_len=64)
    engine.runner.profile_forward(num_tokens=150, max_seq_len=64, num_sampled=4)  # 64 + 64 + 22 tokens


# -- KV sizing ---------------------------------------------------------------------------------------------


def test_kv_budget_arithmetic() -> None:
    memory = DeviceMemory(total_bytes=80 * GIB, free_bytes=70 * GIB, peak_used_bytes=8 * GIB)
    assert kv_budget_bytes(memory, 0.5) == 32 * GIB
    assert kv_budget_bytes(memory, 1.0) == 70 * GIB  # capped by what is free
    assert kv_budget_bytes(memory, 0.5, reserve_bytes=GIB) == 31 * GIB
    per_block = kv_bytes_per_block(16, 4, 2, 64, torch.bfloat16)
    assert num_blocks_for_device_memory(memory, 0.5, 16, 4, 2, 64, torch.bfloat16) == 32 * GIB // per_block
    with pytest.raises(ValueError, match=r"0.1 x 80.00 GiB total - 8.00 GiB used .* 1.00 GiB reserved"):
        num_blocks_for_device_memory(memory, 0.1, 16, 4, 2, 64, torch.bfloat16, reserve_bytes=GIB)


class FakeGpuMemory:
    """PyTorch's allocator counters for one device, driven by what the fake profiled passes allocate."""

    def __init__(self, total: int, held_by_others: int, weights: int, bytes_per_token: int) -> None:
        self.total, self.others = total, held_by_others
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = weights
        self.bytes_per_token = bytes_per_token
        self.profiled: list[tuple[int, int, int]] = []

    def profile_forward(self, num_tokens: int, max_seq_len: int, num_sampled: int) -> None:
        self.profiled.append((num_tokens, max_seq_len, num_sampled))
        activations = num_tokens * self.bytes_per_token
        self.reserved = max(self.reserved, self.allocated + activations)  # cached after the pass
        self.peak_allocated = max(self.peak_allocated, self.allocated + activations)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def reset_peaks(device: object = None) -> None:
            self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

        def empty_cache() -> None:
            self.reserved = self.allocated

        fakes: dict[str, Callable[..., Any]] = {
            "is_available": lambda: True,
            "synchronize": lambda device=None: None,
            "reset_peak_memory_stats": reset_peaks,
            "empty_cache": empty_cache,
            "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.peak_allocated,
            "max_memory_reserved": lambda device=None: self.peak_reserved,
            "mem_get_info": lambda device=None: (self.total - self.others - self.reserved, self.total),
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(torch.cuda, name, fake)


@pytest.mark.parametrize("graph_logits", [False, True])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_gpu_pool_is_sized_after_profiling_the_largest_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cuda_graphs: bool, graph_logits: bool
) -> None:
    mib = 2**20
    fake = FakeGpuMemory(total=80 * GIB, held_by_others=GIB, weights=3 * GIB, bytes_per_token=mib)
    fake.install(monkeypatch)
    config = EngineConfig(
        attention_backend="triton", cuda_graphs=cuda_graphs, max_num_seqs=64, max_num_batched_tokens=4096,
        cuda_graph_logits=graph_logits,
    )  # fmt: skip
    shape = (16, 4, 2, 64, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="tokenmill.runner.kv_cache"):
        blocks = kv_cache_module._num_blocks_on_gpu(
            config, shape, 2048, torch.device("cuda"), fake.profile_forward
        )
    step = (4096, 2048, 64)  # two full-length sequences; 64 rows sampled
    graph_step = (64, 1, 16 if graph_logits else 0)  # graphs of up to 16 rows compute logits
    assert fake.profiled == ([graph_step] if cuda_graphs else []) + [step]
    graph_reserve = 64 * mib if cuda_graphs else 0
    budget = int(0.9 * 80 * GIB) - (3 * GIB + 4096 * mib) - graph_reserve
    assert blocks == budget // kv_bytes_per_block(*shape)
    assert f"KV budget {budget / GIB:.2f} GiB" in caplog.text
    assert "activations of a 4096-token step" in caplog.text
