"""Decode graphs, step inputs, overlap's KV reservation and KV sizing, on CPU: everything around the
capture itself.

The capture and replay need a GPU (the tests marked so below); here the graph runner runs the same
computation eagerly over the same static, padded buffers, and the engine's tokens are checked against the
single-sequence reference loop. Overlap runs as the engine drives it: the scheduler reserves the next
step's KV slots (``Scheduler.reserve_next_step``), then the runner starts that step. KV sizing runs
against fake device-memory counters.
"""

import dataclasses
import itertools
import logging
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from engine_helpers import engine_for, run_to_completion
from kv_helpers import make_sequence, slot_of
from tokenmill import SamplingParams
from tokenmill.cache.kv_cache_manager import PagedKVCacheManager
from tokenmill.cache.kv_pool import (
    DeviceMemory,
    kv_budget_bytes,
    kv_bytes_per_block,
    num_blocks_for_device_memory,
)
from tokenmill.config import EngineConfig, SchedulerConfig
from tokenmill.engine.hardware_defaults import Platform, resolve_config
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import load_model
from tokenmill.outputs import RowLogprobs
from tokenmill.reference import greedy_generate
from tokenmill.runner import cuda_graphs as cuda_graphs_module
from tokenmill.runner import memory_profile
from tokenmill.runner.cuda_graphs import (
    DecodeGraphRunner,
    DecodeInputs,
    cuda_graph_batch_sizes,
    cuda_graph_sizes,
    is_decode_step,
    padded_batch_size,
)
from tokenmill.runner.step_inputs import PackedLayout, batch_step_arrays, build_step_arrays, pack_to_device
from tokenmill.scheduler.output import ScheduledChunk, SchedulerOutput, StepResult
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.sequence import FinishReason, Sequence

GIB = 2**30
CPU = torch.device("cpu")


def config_with(**options: Any) -> EngineConfig:
    """The config as an engine on a Hopper GPU with Triton resolves it."""
    config = EngineConfig().with_options(**options)
    return resolve_config(config, Platform(torch.device("cuda"), True, True), max_model_len=2048)


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
    with pytest.raises(ValueError, match=r"EngineConfig.cuda_graphs must be off when attention_backend"):
        config_with(cuda_graphs=True, attention_backend="torch")
    with pytest.raises(ValueError, match=r"EngineConfig.cuda_graphs must be off when kv_cache is 'none'"):
        config_with(cuda_graphs=True, attention_backend="triton", kv_cache="none")
    with pytest.raises(ValueError, match=r"EngineConfig.cuda_graph_max_batch_size must be at least 1"):
        config_with(cuda_graph_max_batch_size=0)
    with pytest.raises(ValueError, match=r"EngineConfig.overlap_decode must be off unless cuda_graphs"):
        config_with(cuda_graphs=False, overlap_decode=True)
    config = config_with(cuda_graphs=True, attention_backend="triton", max_num_seqs=20)
    assert cuda_graph_sizes(config, torch.device("cuda")) == (1, 2, 4, 8, 16, 20)
    capped = config_with(cuda_graphs=True, attention_backend="triton", cuda_graph_max_batch_size=4)
    assert cuda_graph_sizes(capped, torch.device("cuda")) == (1, 2, 4)
    sequential = config_with(cuda_graphs=True, attention_backend="triton", batching="sequential")
    assert cuda_graph_sizes(sequential, torch.device("cuda")) == (1,)
    default = config_with()  # on a GPU the defaults capture every decode size up to max_num_seqs
    assert default.graphs.enabled and default.graphs.overlap_decode
    assert cuda_graph_sizes(default, torch.device("cuda"))[-1] == default.scheduler.max_num_seqs == 256
    assert cuda_graph_sizes(config_with(cuda_graphs=False), torch.device("cuda")) == ()
    assert cuda_graph_sizes(config, CPU) == ()  # ignored on CPU


# -- step inputs -------------------------------------------------------------------------------------------


def test_packed_inputs_keep_values_shapes_and_alignment() -> None:
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {
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


def _decode_step(engine: LLMEngine, prompts: list[list[int]]) -> SchedulerOutput:
    """Queue ``prompts``, run their prefills, and schedule the decode step after them (not run)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    engine.step()  # the prefills
    scheduled = engine.scheduler.schedule()
    assert is_decode_step(scheduled.chunks)
    return scheduled


def test_static_decode_inputs_equal_the_eager_step_arrays(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, block_size=4, num_kv_blocks=64, max_model_len=64)
    scheduled = _decode_step(engine, [list(range(10, 12)), list(range(20, 29)), list(range(40, 45))])
    chunks = scheduled.chunks
    kv = engine.kv_cache.manager
    assert isinstance(kv, PagedKVCacheManager)
    eager = build_step_arrays(chunks, kv)  # what an eager step copies to the device
    inputs = DecodeInputs(capacity=8, table_width=16, device=CPU)
    inputs.write(chunks, kv, num_rows=4)
    views, count = inputs.views, len(chunks)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert views[name][:count].tolist() == eager[name].tolist(), name
    assert views["query_start_loc"][: count + 1].tolist() == eager["query_start_loc"].tolist() == [0, 1, 2, 3]
    # Independent of both: each row is its sequence's last token, at its position, in its own slot.
    assert views["input_ids"][:count].tolist() == [c.seq.token_ids[c.start] for c in chunks]
    assert views["positions"][:count].tolist() == [c.start for c in chunks]
    assert views["seq_lens"][:count].tolist() == [c.start + 1 for c in chunks]
    assert views["slot_mapping"][:count].tolist() == [slot_of(kv, c.seq, c.start) for c in chunks]
    eager_tables = eager["block_tables"]
    assert views["block_tables"][:count, : eager_tables.shape[1]].tolist() == eager_tables.tolist()
    assert eager_tables.tolist() == [
        kv.block_table(c.seq) + [0] * (eager_tables.shape[1] - len(kv.block_table(c.seq))) for c in chunks
    ]
    assert not views["block_tables"][:count, eager_tables.shape[1] :].any()
    # Row 3 pads the batch to 4: it writes nowhere and reads one token of block 0.
    input_ids, positions, metadata = inputs.view(4, 64)
    assert input_ids[3] == 0 and positions[3] == 0
    assert metadata.slot_mapping is not None and metadata.block_tables is not None
    assert metadata.slot_mapping[3:].eq(-1).all() and metadata.seq_lens[3:].eq(1).all()
    assert not metadata.block_tables[3].any()
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert metadata.max_query_len == 1 and metadata.max_seq_len == 64 and metadata.num_seqs == 4
    # Token ids given on the device replace the sequences' own (the overlapped next step's inputs), at
    # slots the scheduler reserved for them.
    assert engine.scheduler.reserve_next_step(scheduled)
    following = [ScheduledChunk(c.seq, c.start + 1, c.end + 1) for c in chunks]
    inputs.write(following, kv, num_rows=4, token_ids=torch.tensor([7, 8, 9]))
    assert views["input_ids"][:4].tolist() == [7, 8, 9, 0]
    assert views["positions"][:3].tolist() == [c.start + 1 for c in chunks]
    assert views["slot_mapping"][:3].tolist() == [slot_of(kv, c.seq, c.start + 1) for c in chunks]
    # A smaller batch afterwards, from the staging buffer the first write filled: its padding rows are
    # rewritten, whatever the last steps left there.
    inputs.write(chunks[:1], kv, num_rows=2)
    assert views["input_ids"][:2].tolist() == [chunks[0].seq.token_ids[chunks[0].start], 0]
    assert views["slot_mapping"][1] == -1 and views["positions"][1] == 0 and views["seq_lens"][1] == 1
    assert views["query_start_loc"][:3].tolist() == [0, 1, 2]
    assert not views["block_tables"][1].any()
    with pytest.raises(ValueError, match="do not fit"):
        inputs.write(chunks, kv, num_rows=2)


def _reserve_even_when_sequences_wait(scheduler: Scheduler) -> list[int]:
    """Make the engine's ``reserve_next_step`` treat the batch as full, so waiting sequences do not stop
    it: next steps are then started, and dropped, on arrivals too. Every other check of the real method
    still applies. Returns a list that records the number of waiting sequences at each reservation made."""
    reserve = scheduler.reserve_next_step
    reserved_while_waiting: list[int] = []

    def reserve_as_if_full(scheduled: SchedulerOutput) -> bool:
        config = scheduler.config
        scheduler.config = dataclasses.replace(config, max_num_seqs=max(1, len(scheduler.running)))
        try:
            reserved = reserve(scheduled)
        finally:
            scheduler.config = config
        if reserved:
            reserved_while_waiting.append(len(scheduler.waiting))
        return reserved

    scheduler.reserve_next_step = reserve_as_if_full  # type: ignore[method-assign]
    return reserved_while_waiting


def _with_static_decode(
    engine: LLMEngine, sizes: tuple[int, ...], overlap: bool = False, logits_in_graph: bool = False
) -> list[int]:
    """Route the engine's decode steps through a graph runner that runs eagerly (no capture on CPU), with
    ``overlap`` as ``overlap_decode`` sets it; returns a list that records the batch size of each step it
    ran. Each step's input arrays (built by the one-chunk builder at batch 1) are checked against the
    batch builder's."""
    kv, runner = engine.kv_cache, engine.runner
    assert kv.layers is not None
    graphs = DecodeGraphRunner(
        runner.model, runner.backend, kv.layers, kv.manager, sizes, engine.max_model_len, logits_in_graph,
        runner.sampler.argmax,
    )  # fmt: skip
    step_arrays, width = graphs.inputs.step_arrays, graphs.inputs.table_width

    def checked(chunks: Any, kv: Any, num_rows: int, with_ids: bool = True, *rest: Any, **named: Any) -> Any:
        arrays = step_arrays(chunks, kv, num_rows, with_ids, *rest, **named)
        general = batch_step_arrays(chunks, kv, num_rows, width, with_token_ids=with_ids)
        for name, array in general.items():
            assert arrays[name].dtype == array.dtype and arrays[name].tolist() == array.tolist(), name
        return arrays

    graphs.inputs.step_arrays = checked  # type: ignore[method-assign]
    runner.decode_graphs = graphs
    runner.overlap = overlap
    return _count_runs(graphs)


def _count_runs(runner: DecodeGraphRunner) -> list[int]:
    """The batch size of every step ``runner`` runs, recorded as they run."""
    calls: list[int] = []
    run = runner.run

    def counted(chunks: Any) -> Any:
        calls.append(len(chunks))
        return run(chunks)

    runner.run = counted  # type: ignore[method-assign]
    return calls


def _graphs(engine: LLMEngine) -> DecodeGraphRunner:
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    return graphs


def _serve_greedy_and_check(  # type: ignore[no-untyped-def]
    tiny, engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: dict[str, int]
) -> None:
    """Serve every prompt greedily (EOS ignored) and compare each output with the reference loop's."""
    requests = {
        rid: (prompt, SamplingParams(temperature=0, max_tokens=max_tokens[rid], ignore_eos=True))
        for rid, prompt in prompts.items()
    }
    outputs = run_to_completion(engine, requests)
    for rid, prompt in prompts.items():
        expected = greedy_generate(tiny.model, prompt, max_tokens[rid]).token_ids
        assert outputs[rid].outputs[0].token_ids == expected, rid


def _check_against_reference(tiny, engine: LLMEngine, calls: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Five requests of different lengths: the batch shrinks from 5 (above the largest size: eager) to
    4, 3 (padded to 4), 2 and 1."""
    prompts = {f"r{i}": list(range(3 + 7 * i, 3 + 7 * i + 2 + 5 * i)) for i in range(5)}
    max_tokens = {rid: 2 + i for i, rid in enumerate(prompts)}  # one request finishes per decode step
    _serve_greedy_and_check(tiny, engine, prompts, max_tokens)
    assert set(calls) == {1, 2, 3, 4}, calls  # batch 5 ran eagerly
    assert engine.kv_cache.manager.num_used_blocks == 0


@pytest.mark.parametrize("logits_in_graph", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_decode_through_static_buffers_matches_the_reference_loop(  # type: ignore[no-untyped-def]
    tiny, overlap: bool, logits_in_graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``logits_in_graph``, steps of up to 2 rows compute their logits and argmax in the graph, the
    padded steps of 4 after it."""
    monkeypatch.setattr(cuda_graphs_module, "GRAPH_LOGITS_MAX_ROWS", 2)
    engine = engine_for(tiny, block_size=4, num_kv_blocks=64, max_model_len=64)
    calls = _with_static_decode(engine, (1, 2, 4), overlap, logits_in_graph=logits_in_graph)
    graphs = _graphs(engine)
    argmax_rows: list[int] = []
    argmax = graphs.argmax

    def recording_argmax(logits: torch.Tensor) -> torch.Tensor:
        argmax_rows.append(len(logits))
        return argmax(logits)

    graphs.argmax = recording_argmax
    _check_against_reference(tiny, engine, calls)
    assert set(argmax_rows) == ({1, 2} if logits_in_graph else set())
    if overlap:  # next steps were started and used, but not where a sequence ends
        assert 0 < graphs.num_reused <= graphs.num_started < len(calls)
    else:
        assert graphs.num_started == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize(("seed", "even_when_waiting"), [(0, True), (2, True), (4, False)])
def test_overlapped_decode_survives_arrivals_aborts_and_preemption(  # type: ignore[no-untyped-def]
    tiny, seed: int, even_when_waiting: bool, prefix_caching: bool
) -> None:
    """Next steps are reserved and started as the engine does; with ``even_when_waiting`` also while
    requests wait, so many are dropped: on arrivals, aborts, finishes and preemptions, and reserved
    blocks are taken ahead of the scheduler. Nothing may change any output, or leave the allocator and
    prefix tree inconsistent (checked every step). The seeds are ones whose workloads drop started steps
    under both settings of ``prefix_caching``."""
    rng = random.Random(seed)
    engine = engine_for(
        tiny, block_size=4, num_kv_blocks=16, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=64,
        prefix_caching=prefix_caching, debug_checks=True,
    )  # fmt: skip
    graphs_calls = _with_static_decode(engine, (1, 2, 4, 6), overlap=True)
    forced = _reserve_even_when_sequences_wait(engine.scheduler) if even_when_waiting else None
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
    for steps in itertools.count():  # a few dozen steps; a leak of blocks would stall admission forever
        assert steps < 1000, "the engine stopped making progress"
        if not (arrivals or engine.has_unfinished_requests()):
            break
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
    graphs = _graphs(engine)
    assert graphs_calls and graphs.num_started >= graphs.num_reused > 0
    assert graphs.num_started > graphs.num_reused  # some started steps were dropped
    if forced is not None:
        assert any(forced), "no next step was started while requests waited"
    assert engine.scheduler_stats().num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert engine.kv_cache.manager.num_used_blocks == 0
    for rid, (prompt, max_tokens) in workload.items():
        expected = greedy_generate(tiny.model, prompt, max_tokens).token_ids
        if rid in doomed:
            assert texts[rid] == expected[: len(texts[rid])], rid
        else:
            assert texts[rid] == expected, rid


def test_a_started_step_is_dropped_when_the_batch_changes(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, block_size=4, num_kv_blocks=64, max_model_len=64)
    _with_static_decode(engine, (1, 2, 4), overlap=True)
    graphs = _graphs(engine)
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
    for _ in range(30):  # c needs 13 steps
        step()
    assert not engine.has_unfinished_requests()
    assert graphs.num_started - graphs.num_reused == 2
    for rid in ("a", "c"):
        assert texts[rid] == greedy_generate(tiny.model, prompts[rid], 12).token_ids, rid
    assert texts["b"] == greedy_generate(tiny.model, prompts["b"], 12).token_ids[: len(texts["b"])]


def test_overlap_with_a_proposer_runs_while_no_step_speculates_or_nothing_was_guessed(tiny) -> None:  # type: ignore[no-untyped-def]
    """With n-gram speculation configured, a decode step is started ahead while the batch is at or above
    ``speculative_disable_by_batch_size`` (no step speculates), and below it only after a step for which
    the proposer guessed nothing. Guesses that come while a started step is in flight for the running
    sequences wait for it (the started step is used, not dropped, and the step after it is not started
    ahead); the greedy tokens are the reference loop's throughout."""
    engine = engine_for(
        tiny, block_size=4, num_kv_blocks=64, max_model_len=64, speculative_method="ngram",
        num_speculative_tokens=3, speculative_disable_by_batch_size=3, debug_checks=True,
    )  # fmt: skip
    _with_static_decode(engine, (1, 2, 4), overlap=True)
    graphs = _graphs(engine)
    started_at: list[tuple[int, int, bool]] = []  # (running batch, sequences given guesses, deferred)
    deferrals: list[int] = []  # graphs.num_started at each deferral
    start, propose = graphs.start_next_step, engine.guessing.propose

    def recording_start(*args: Any) -> None:
        guessing = engine.guessing
        started_at.append((len(engine.scheduler.running), guessing.num_guessing, guessing.deferred))
        start(*args)

    def recording_propose(*args: Any) -> None:
        propose(*args)
        if engine.guessing.deferred:
            assert not any(seq.draft_token_ids for seq in engine.scheduler.running)
            deferrals.append(graphs.num_started)

    graphs.start_next_step = recording_start  # type: ignore[method-assign]
    engine.guessing.propose = recording_propose  # type: ignore[method-assign]
    prompts = {f"r{i}": [5, 6, 7, 8] * 3 + [9 + i] * (i + 1) for i in range(4)}
    max_tokens = {rid: 4 + 5 * i for i, rid in enumerate(prompts)}  # the batch shrinks 4, 3, 2, 1
    _serve_greedy_and_check(tiny, engine, prompts, max_tokens)
    assert all(batch >= 3 or (guessing == 0 and not deferred) for batch, guessing, deferred in started_at)
    assert any(batch < 3 for batch, _, _ in started_at)  # below the cutoff, after a step without guesses
    assert deferrals and graphs.num_reused > 0  # guesses came while a started step was in flight
    assert graphs.num_started == graphs.num_reused  # ... and it was used each time, not dropped
    assert engine.scheduler_stats().spec_decode.num_steps > 0  # and speculated below the cutoff
    assert engine.kv_cache.manager.num_used_blocks == 0


def test_a_capture_of_one_padding_row_takes_the_general_builders_arrays(tiny) -> None:  # type: ignore[no-untyped-def]
    """Capture writes every row as padding; at one row (a capacity of 1) the one-chunk builder is not for
    it, and the arrays are the batch builder's."""
    engine = engine_for(tiny, block_size=4, num_kv_blocks=16, max_model_len=32)
    _with_static_decode(engine, (1,))
    inputs, kv = _graphs(engine).inputs, engine.kv_cache.manager
    padding = inputs.step_arrays([], kv, 1)
    assert padding["seq_lens"].tolist() == [1] and padding["slot_mapping"].tolist() == [-1]
    inputs.write([], kv, 1)


def test_a_step_is_started_ahead_for_the_sequences_that_outlive_this_one(tiny) -> None:  # type: ignore[no-untyped-def]
    """Sequences ending by length at staggered steps: each step after an ending is started ahead for the
    others alone (their sampled tokens gathered on the device) and used, so every step but the first
    and the last is overlapped; the tokens are the reference loop's."""
    engine = engine_for(tiny, block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=4)
    _with_static_decode(engine, (1, 2, 4), overlap=True)
    graphs = _graphs(engine)
    prompts = {f"r{i}": list(range(5 + 9 * i, 12 + 9 * i)) for i in range(4)}
    max_tokens = {rid: 3 + 2 * i for i, rid in enumerate(prompts)}  # the batch shrinks every 2 steps
    _serve_greedy_and_check(tiny, engine, prompts, max_tokens)
    decode_steps = max(max_tokens.values()) - 1  # the prefill samples each first token
    assert graphs.num_started == graphs.num_reused == decode_steps - 1


def test_a_started_step_is_used_by_exactly_its_rows_and_gives_their_logits(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, block_size=4, num_kv_blocks=64, max_model_len=64)
    _with_static_decode(engine, (1, 2, 4), overlap=True)
    graphs, scheduler = _graphs(engine), engine.scheduler
    scheduled = _decode_step(engine, [[5, 6, 7], list(range(20, 29)), [40, 41]])  # padded to 4 rows
    first = graphs.run(scheduled.chunks).logits.clone()
    sampled = first.argmax(dim=-1)
    assert scheduler.reserve_next_step(scheduled)
    graphs.start_next_step(scheduled.chunks, sampled)
    assert torch.equal(graphs.run(scheduled.chunks).logits, first)  # the same step again: computed afresh
    assert (graphs.num_started, graphs.num_reused) == (1, 0)
    tokens: dict[Sequence, list[tuple[int, RowLogprobs | None]]] = {
        c.seq: [(token, None)] for c, token in zip(scheduled.chunks, sampled.tolist(), strict=True)
    }
    scheduler.update(scheduled, StepResult(sampled=tokens))
    following = scheduler.schedule().chunks
    graphs.start_next_step(scheduled.chunks, sampled)
    started = graphs.run(following).logits.clone()
    assert (graphs.num_started, graphs.num_reused) == (2, 1)
    fresh = graphs.run(following).logits.clone()  # nothing started now: computed from the sequences
    assert graphs.num_reused == 1 and torch.equal(started, fresh)
    graphs.start_next_step(scheduled.chunks, sampled)
    swapped = graphs.run(following[::-1]).logits  # the same rows in another order are another step
    assert graphs.num_reused == 1
    torch.testing.assert_close(swapped, fresh.flip(0))


def test_next_steps_start_only_after_decode_graph_steps_read_by_their_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    """The runner's half of the engine's overlap condition: overlap on, the step ran through the decode
    graphs, and reading it needs only its token ids (no logprobs)."""
    engine = engine_for(tiny, block_size=4, num_kv_blocks=64, max_model_len=64)
    runner, scheduler = engine.runner, engine.scheduler
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def execute() -> tuple[SchedulerOutput, Any]:
        scheduled = scheduler.schedule()
        return scheduled, runner.execute(scheduled.chunks)

    engine.add_request("a", [5, 6, 7], plain)
    scheduled, prefill = execute()
    assert not runner.can_start_next_step(prefill)  # no decode graphs
    _with_static_decode(engine, (1, 2), overlap=False)
    scheduler.update(scheduled, prefill.result())
    scheduled, decode = execute()
    assert is_decode_step(scheduled.chunks) and not runner.can_start_next_step(decode)  # overlap off
    runner.overlap = True
    assert runner.can_start_next_step(decode) and not runner.can_start_next_step(prefill)
    scheduler.update(scheduled, decode.result())
    engine.add_request("b", [8, 9], dataclasses.replace(plain, logprobs=2))
    scheduled, mixed = execute()  # a's decode and b's prefill
    assert not runner.can_start_next_step(mixed)
    scheduler.update(scheduled, mixed.result())
    scheduled, decode = execute()
    assert is_decode_step(scheduled.chunks) and len(scheduled.chunks) == 2
    assert not runner.can_start_next_step(decode)  # b's logprobs are read too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing CUDA graphs needs a GPU")
@pytest.mark.parametrize("overlap", [False, True])
def test_captured_graphs_match_the_reference_loop(tiny_llama_folder, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    loaded = load_model(tiny_llama_folder, device="cuda", dtype="float32")
    engine = engine_for(
        loaded, device="cuda", attention_backend="triton", cuda_graphs=True, overlap_decode=overlap,
        cuda_graph_max_batch_size=4, block_size=4, num_kv_blocks=64, max_model_len=64,
    )  # fmt: skip
    graphs = _graphs(engine)
    assert sorted(graphs.graphs) == [1, 2, 4]
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
        options = engine.runner.model.kernel_options  # bound to the engine's copy of the model
        assert options.pdl == pdl and options.gemv
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


# -- overlap's KV reservation (the scheduler's half) -------------------------------------------------------


def _decoding(
    prompt_lens: list[int],
    num_blocks: int,
    max_tokens: int = 16,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
) -> tuple[Scheduler, PagedKVCacheManager, list[Sequence]]:
    """A scheduler (blocks of 4 tokens) whose sequences have run their prefills and sampled a token."""
    kv = PagedKVCacheManager(num_blocks, block_size=4)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256)
    scheduler = Scheduler(config, kv, max_model_len)
    seqs = [make_sequence(f"s{i}", range(1, n + 1), max_tokens) for i, n in enumerate(prompt_lens)]
    for seq in seqs:
        scheduler.add(seq)
    _update(scheduler, scheduler.schedule())
    assert all(seq.num_output_tokens == 1 for seq in seqs)
    return scheduler, kv, seqs


def _update(scheduler: Scheduler, scheduled: SchedulerOutput) -> None:
    """Take in a step whose every sampled sequence drew token 5."""
    sampled: dict[Sequence, list[tuple[int, RowLogprobs | None]]] = {
        c.seq: [(5, None)] for c in scheduled.chunks if c.samples_next_token
    }
    scheduler.update(scheduled, StepResult(sampled=sampled))


def _tables(kv: PagedKVCacheManager, seqs: list[Sequence]) -> list[list[int]]:
    return [kv.block_table(seq) for seq in seqs]


def test_reserving_the_next_step_takes_exactly_its_new_blocks() -> None:
    # 4, 5, 8 and 7 tokens after the prefill: the decode step fills slots 3, 4, 7 and 6, so the next one
    # needs a new block for the 1st and the 3rd sequence only.
    scheduler, kv, seqs = _decoding([3, 4, 7, 6], num_blocks=16)
    for _ in range(3):
        scheduled = scheduler.schedule()
        assert is_decode_step(scheduled.chunks)
        before, free = _tables(kv, seqs), kv.num_free_blocks
        new_blocks = sum(c.start % 4 == 3 for c in scheduled.chunks)
        assert scheduler.reserve_next_step(scheduled)
        assert kv.num_free_blocks == free - new_blocks
        for seq, table, chunk in zip(seqs, before, scheduled.chunks, strict=True):
            assert kv.block_table(seq)[: len(table)] == table  # grown, never changed
            assert len(kv.block_table(seq)) == -(-(chunk.start + 2) // 4)
            slot_of(kv, seq, chunk.start + 1)  # the next step's token has a slot
        _update(scheduler, scheduled)
        following = scheduler.schedule()  # exactly the step the runner started, with nothing more taken
        assert [(c.seq, c.start, c.end) for c in following.chunks] == [
            (c.seq, c.start + 1, c.end + 1) for c in scheduled.chunks
        ]
        assert kv.num_free_blocks == free - new_blocks
        _update(scheduler, following)
    kv.check_integrity()
    table = kv.block_table(seqs[0])
    scheduler.finish(seqs[0], FinishReason.STOP)  # a sequence that ends frees its reserved block too
    assert kv.num_free_blocks == free - new_blocks + len(table)
    kv.check_integrity()


def test_reserving_is_refused_while_a_waiting_sequence_could_join() -> None:
    scheduler, kv, seqs = _decoding([3, 4, 7], num_blocks=16, max_num_seqs=4)
    scheduled = scheduler.schedule()
    scheduler.add(make_sequence("late", [1, 2, 3]))
    tables, free = _tables(kv, seqs), kv.num_free_blocks
    assert scheduler.reserve_next_step(scheduled) is None
    assert _tables(kv, seqs) == tables and kv.num_free_blocks == free
    _update(scheduler, scheduled)
    assert len(scheduler.schedule().chunks) == 4  # it did join
    # With the batch full, a waiting sequence cannot join: the next step is the same sequences.
    full, _, _ = _decoding([3, 4, 7], num_blocks=16, max_num_seqs=3)
    scheduled = full.schedule()
    full.add(make_sequence("late", [1, 2, 3]))
    assert full.reserve_next_step(scheduled) == [0, 1, 2]


@pytest.mark.parametrize(("max_tokens", "rows"), [(2, [0]), (3, [0, 1])])
def test_a_sequence_ending_by_max_tokens_is_left_out_of_the_next_step(
    max_tokens: int, rows: list[int]
) -> None:
    """After the prefill each sequence has 1 output token and the decode step samples the 2nd: with
    ``max_tokens=2`` the 2nd sequence ends there, so the next step runs the 1st alone, and only the 1st
    takes a slot."""
    scheduler, kv, seqs = _decoding([3, 8], num_blocks=16)
    seqs[1].max_tokens = max_tokens
    scheduled = scheduler.schedule()
    tables = _tables(kv, seqs)
    assert scheduler.reserve_next_step(scheduled) == rows
    if rows == [0]:
        assert _tables(kv, seqs)[1] == tables[1]
    _update(scheduler, scheduled)
    assert seqs[1].is_finished == (rows == [0])
    following = scheduler.schedule()  # what the runner started: the rows that continue, one token on
    assert [(c.seq, c.start) for c in following.chunks] == [
        (scheduled.chunks[r].seq, scheduled.chunks[r].start + 1) for r in rows
    ]


def test_an_ending_sequence_with_others_waiting_starts_nothing() -> None:
    """A sequence that ends frees room for a waiting one, which the next step then admits."""
    scheduler, kv, seqs = _decoding([3, 8], num_blocks=16, max_num_seqs=2)
    seqs[1].max_tokens = 2
    scheduled = scheduler.schedule()
    scheduler.add(make_sequence("late", [1, 2, 3]))
    tables, free = _tables(kv, seqs), kv.num_free_blocks
    assert scheduler.reserve_next_step(scheduled) is None
    assert _tables(kv, seqs) == tables and kv.num_free_blocks == free


@pytest.mark.parametrize(("max_model_len", "rows"), [(10, [0]), (11, [0, 1])])
def test_a_sequence_ending_by_the_context_limit_is_left_out_of_the_next_step(
    max_model_len: int, rows: list[int]
) -> None:
    """The 9-token prompt holds 10 tokens after its decode step: at ``max_model_len=10`` it ends there."""
    scheduler, kv, seqs = _decoding([3, 8], num_blocks=16, max_model_len=max_model_len)
    scheduled = scheduler.schedule()
    assert [c.start for c in scheduled.chunks] == [3, 8]
    tables = _tables(kv, seqs)
    assert scheduler.reserve_next_step(scheduled) == rows
    if rows == [0]:
        assert _tables(kv, seqs)[1] == tables[1]
    _update(scheduler, scheduled)
    assert seqs[1].is_finished == (rows == [0])


@pytest.mark.parametrize(("num_blocks", "reserves"), [(5, None), (6, [0, 1, 2])])
def test_reserving_is_all_or_nothing_when_blocks_are_short(
    num_blocks: int, reserves: list[int] | None
) -> None:
    """Holding 1, 2 and 1 blocks, the 1st and 2nd sequence need one more each for the next step: with
    one block free neither gets it."""
    scheduler, kv, seqs = _decoding([3, 7, 1], num_blocks=num_blocks)
    scheduled = scheduler.schedule()
    free = kv.num_free_blocks
    assert free == num_blocks - 4
    tables = _tables(kv, seqs)
    assert scheduler.reserve_next_step(scheduled) == reserves
    if reserves:
        assert kv.num_free_blocks == free - 2 and [len(t) for t in _tables(kv, seqs)] == [2, 3, 1]
    else:
        assert _tables(kv, seqs) == tables and kv.num_free_blocks == free
    kv.check_integrity()


def test_profile_forward_runs_the_largest_step_without_the_kv_cache(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny, block_size=4, num_kv_blocks=8, max_model_len=64)
    runner = engine.runner
    lengths: list[list[int]] = []
    forward = runner.model.forward

    def recording(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        lengths.append(
            [int(n) for n in (positions == 0).nonzero().flatten().diff(append=torch.tensor([150]))]
        )
        return forward(input_ids, positions)

    runner.model.forward = recording  # type: ignore[method-assign]
    memory_profile.profile_forward(
        runner.model, runner.backend, runner.sampler, num_tokens=150, max_seq_len=64, num_sampled=4
    )
    assert lengths == [[64, 64, 22]]
    assert engine.kv_cache.layers is not None
    assert not any(layer.key.any() or layer.value.any() for layer in engine.kv_cache.layers)


# -- KV sizing ---------------------------------------------------------------------------------------------


def test_kv_budget_arithmetic() -> None:
    # 8 GiB peak: 3 GiB of weights still held, 5 GiB of profiled activations handed back
    memory = DeviceMemory(
        total_bytes=80 * GIB, free_bytes=70 * GIB, peak_used_bytes=8 * GIB, reserved_bytes=3 * GIB
    )
    assert kv_budget_bytes(memory, 0.5) == 32 * GIB
    assert kv_budget_bytes(memory, 0.5, reserve_bytes=GIB) == 31 * GIB
    per_block = kv_bytes_per_block(16, 4, 2, 64, torch.bfloat16)
    assert num_blocks_for_device_memory(memory, 0.5, 16, 4, 2, 64, torch.bfloat16) == 32 * GIB // per_block
    with pytest.raises(ValueError, match=r"0.1 x 80.00 GiB total, .* 8.00 GiB used .* 1.00 GiB reserved"):
        num_blocks_for_device_memory(memory, 0.1, 16, 4, 2, 64, torch.bfloat16, reserve_bytes=GIB)


def test_a_pool_sized_by_the_free_memory_leaves_the_activations_their_room() -> None:
    """Others hold 60 of 80 GiB: this process, holding its 3 GiB of weights, can reach 20 + 3 GiB, and its
    largest step needs 5 GiB beside them, so the pool gets 15 GiB (it took all 20 free GiB before, leaving
    the step nothing: an engine on a shared GPU ran out of memory at its first prefill, or at the pool)."""
    shared = DeviceMemory(
        total_bytes=80 * GIB, free_bytes=20 * GIB, peak_used_bytes=8 * GIB, reserved_bytes=3 * GIB
    )
    budget = kv_budget_bytes(shared, 0.9)
    assert budget == 20 * GIB + 3 * GIB - 8 * GIB
    assert budget + shared.peak_used_bytes <= shared.free_bytes + shared.reserved_bytes  # all of it fits


def test_a_per_process_memory_fraction_caps_the_pool() -> None:
    """Under torch.cuda.set_per_process_memory_fraction(0.25) the process may reserve 20 of 80 GiB: 0.9 of
    that, less the 8 GiB peak, not 0.9 of the whole device (which the allocator would refuse)."""
    capped = DeviceMemory(80 * GIB, 70 * GIB, 8 * GIB, 3 * GIB, process_fraction=0.25)
    assert capped.usable_bytes == 20 * GIB
    budget = kv_budget_bytes(capped, 0.9)
    assert budget == int(0.9 * 20 * GIB) - 8 * GIB
    assert budget + capped.peak_used_bytes <= capped.usable_bytes
    with pytest.raises(ValueError, match=r"0.1 x 20.00 GiB \(0.25 of 80.00\)"):
        num_blocks_for_device_memory(capped, 0.1, 16, 4, 2, 64, torch.bfloat16)


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
            "memory_reserved": lambda device=None: self.reserved,
            "current_device": lambda: 0,
            "get_per_process_memory_fraction": lambda device: 1.0,
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
    config = config_with(
        attention_backend="triton", cuda_graphs=cuda_graphs, max_num_seqs=64, max_num_batched_tokens=4096,
        cuda_graph_logits=graph_logits,
    )  # fmt: skip
    cuda = torch.device("cuda")
    plan = memory_profile.ProfilePlan.for_config(config, 2048, cuda)
    assert plan == memory_profile.ProfilePlan(
        step_tokens=4096, step_seq_len=2048, step_sampled=64, graph_batch=64 if cuda_graphs else 0,
        graph_sampled=16 if cuda_graphs and graph_logits else 0,
    )  # fmt: skip
    small = config_with(max_num_seqs=64, max_num_batched_tokens=48, chunked_prefill=True, cuda_graphs=False)
    assert memory_profile.ProfilePlan.for_config(small, 2048, cuda) == memory_profile.ProfilePlan(
        48, 48, 48, 0, 0
    )
    shape = (16, 4, 2, 64, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="tokenmill.runner.memory_profile"):
        blocks = memory_profile.num_blocks_on_gpu(config, shape, 2048, cuda, fake.profile_forward)
    step = (4096, 2048, 64)  # two full-length sequences; 64 rows sampled
    graph_step = (64, 1, 16 if graph_logits else 0)  # graphs of up to 16 rows compute logits
    assert fake.profiled == ([graph_step] if cuda_graphs else []) + [step]
    graph_reserve = 64 * mib if cuda_graphs else 0
    budget = int(0.9 * 80 * GIB) - (3 * GIB + 4096 * mib) - graph_reserve
    assert blocks == budget // kv_bytes_per_block(*shape)
    assert f"KV budget {budget / GIB:.2f} GiB" in caplog.text
    assert "activations of a 4096-token step" in caplog.text


def test_gpu_pool_without_a_profile_counts_only_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeGpuMemory(total=80 * GIB, held_by_others=GIB, weights=3 * GIB, bytes_per_token=2**20)
    fake.install(monkeypatch)
    shape = (16, 4, 2, 64, torch.bfloat16)
    blocks = memory_profile.num_blocks_on_gpu(config_with(), shape, 2048, torch.device("cuda"), None)
    assert fake.profiled == []
    assert blocks == (int(0.9 * 80 * GIB) - 3 * GIB) // kv_bytes_per_block(*shape)
