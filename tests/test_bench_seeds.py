"""``tokenmill bench seeds`` at tiny sizes on a tiny random GPT-2 (CPU): each table measures what it says,
checked against a naive computation (tokens a recomputing engine must process, KV bytes of a slab or a
block, the batch at which each layout runs out), and the whole command writes its report and plot."""

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from cli_helpers import run_cli
from engine_helpers import in_thread
from tokenmill.benchmarks.report import pyplot
from tokenmill.benchmarks.seeds import command
from tokenmill.benchmarks.seeds.batch_scaling import measure_batch_scaling
from tokenmill.benchmarks.seeds.engines import (
    SeedSetup,
    base_config,
    fixed_workload,
    run_on_engine,
    serve_at_once,
)
from tokenmill.benchmarks.seeds.kv_memory import measure_kv_memory
from tokenmill.benchmarks.seeds.kv_speed import CACHED, RECOMPUTE, measure_kv_speed, speed_config
from tokenmill.benchmarks.seeds.published import KV_CACHE_SPEEDUP
from tokenmill.benchmarks.seeds.report import Roofline, render
from tokenmill.benchmarks.seeds.serving import BATCHED, SEQUENTIAL, LoadRun, closed_loop
from tokenmill.benchmarks.seeds.sizes import PRESETS, SeedSizes, check_sizes
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import load_model

N_LAYER, N_EMBD = 3, 64  # tiny_models' GPT-2
CONTEXT = 256
TINY = SeedSizes(
    gen_lens=(4, 12),
    gen_prompt_len=8,
    prompt_lens=(8, 24),
    prompt_gen_len=4,
    batch_sizes=(1, 3),
    batch_input_len=8,
    batch_output_len=20,
    memory_batch_sizes=(1, 2, 4, 8, 16),
    memory_input_len=8,
    memory_output_len=8,
    context_len=CONTEXT,
    paged_pool_gib=6.5 * 16 * 2 * N_LAYER * N_EMBD * 4 / 2**30,  # 6 whole blocks of 16 tokens
    kv_limit_gib=5.5 * CONTEXT * 2 * N_LAYER * N_EMBD * 4 / 2**30,  # 5 whole contiguous slabs
    users=(1, 3),
    min_requests=3,
    serve_input_len=8,
    serve_output_len=6,
    repeats=2,
)
KV_BYTES_PER_TOKEN = 2 * N_LAYER * N_EMBD * 4  # K and V, every layer, float32: the naive count


@pytest.fixture(scope="module")
def tiny_gpt2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny-gpt2-seeds")
    save_tiny_model("gpt2", folder)
    return folder


@pytest.fixture(scope="module")
def setup(tiny_gpt2_folder: Path) -> SeedSetup:
    loaded = load_model(tiny_gpt2_folder, dtype="float32", max_model_len=CONTEXT)
    return SeedSetup(loaded, TINY, base_config(loaded, str(tiny_gpt2_folder), "auto", 0, CONTEXT))


def count_forward_tokens(engine: LLMEngine) -> list[int]:
    """Patch the engine's model to record how many tokens each forward pass processes."""
    counts: list[int] = []
    model = engine.runner.model
    original = model.forward

    def counting(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        counts.append(int(input_ids.numel()))
        return original(input_ids, positions)

    model.forward = counting  # type: ignore[method-assign]
    return counts


def test_the_recompute_engine_processes_the_whole_sequence_every_step(setup: SeedSetup) -> None:
    """And the cached engine the prompt once, on a second row with the same prompt too (the prefix cache
    is emptied between rows, so no row is served from an earlier one)."""
    prompt, generated = 20, 12  # a full block of the prompt would be cached
    workload = fixed_workload(setup, 1, prompt, generated)
    processed = {}

    def forward_tokens_of_two_rows(engine: LLMEngine) -> float:
        counts = count_forward_tokens(engine)
        for _ in range(2):
            run = in_thread(lambda: serve_at_once(engine, workload))
            assert run.output_tokens == generated
        return sum(counts) / 2

    for mode in (CACHED, RECOMPUTE):
        processed[mode] = run_on_engine(setup, speed_config(setup, mode), forward_tokens_of_two_rows)
    assert processed[CACHED] == prompt + generated - 1  # the prompt once, then one token per step
    assert processed[RECOMPUTE] == sum(prompt + step for step in range(generated))


def test_the_kv_cache_table_has_a_row_per_length_and_the_seed_beside_its_lengths(setup: SeedSetup) -> None:
    rows = in_thread(lambda: measure_kv_speed(setup))
    shapes = [(r.axis, r.prompt_len, r.gen_len) for r in rows]
    assert shapes == [
        ("generation length", 8, 4), ("generation length", 8, 12),
        ("prompt length", 8, 4), ("prompt length", 24, 4),
    ]  # fmt: skip
    for row in rows:
        assert row.cached_tok_s > 0 and row.recompute_tok_s > 0
        assert row.speedup == pytest.approx(row.cached_tok_s / row.recompute_tok_s)
        assert row.seed_speedup is None  # no published number for these lengths
    published = replace(rows[0], gen_len=1000)
    assert published.seed_speedup == KV_CACHE_SPEEDUP[1000]
    assert replace(published, axis="prompt length").seed_speedup is None


def test_each_batch_gets_a_pool_of_exactly_its_size_and_fills_it(setup: SeedSetup) -> None:
    rows = in_thread(lambda: measure_batch_scaling(setup))
    blocks_per_sequence = -(-(TINY.batch_input_len + TINY.batch_output_len) // 16)
    for row, batch in zip(rows, TINY.batch_sizes, strict=True):
        naive = batch * blocks_per_sequence * 16 * KV_BYTES_PER_TOKEN
        run = row.run
        assert run.kv_pool_bytes == naive
        assert run.peak_kv_used_bytes == naive  # every sequence at full length on the last step
        assert run.output_tokens == batch * TINY.batch_output_len
        assert run.peak_running == batch and run.preemptions == 0
        assert run.tokens_per_s == pytest.approx(run.output_tokens / run.elapsed_s)
        assert run.peak_memory_bytes > naive  # the process holds at least its KV pool (and the weights)


def test_the_memory_table_runs_out_where_the_naive_count_says(setup: SeedSetup) -> None:
    table = in_thread(lambda: measure_kv_memory(setup))
    slab = CONTEXT * KV_BYTES_PER_TOKEN
    block = 16 * KV_BYTES_PER_TOKEN
    pool_blocks = int(TINY.paged_pool_gib * 2**30) // block
    blocks_per_sequence = -(-(TINY.memory_input_len + TINY.memory_output_len) // 16)
    limit = TINY.kv_limit_gib * 2**30
    batches = TINY.memory_batch_sizes
    assert pool_blocks == 6
    assert table.contiguous_oom() == next(b for b in batches if b * slab > limit) == 8
    assert table.paged_exhausted() == next(b for b in batches if b * blocks_per_sequence > pool_blocks) == 8
    assert table.crossover() == next(b for b in batches if b * slab > pool_blocks * block) == 1
    for row in table.rows:
        assert row.contiguous_bytes == row.batch_size * slab
        assert row.paged.kv_pool_bytes == pool_blocks * block
        assert row.paged.peak_kv_used_bytes < row.contiguous_bytes  # paged holds less at every batch here
        if row.contiguous is not None:  # ran: its engine allocated the naive slabs, all sequences at once
            assert row.contiguous.kv_pool_bytes == row.contiguous_bytes
            assert row.contiguous.peak_running == row.batch_size
            assert row.paged.peak_kv_used_bytes == row.batch_size * blocks_per_sequence * block
        else:
            assert row.contiguous_failure
        if row.paged_exhausted:  # it still served every request, a few at a time
            assert row.paged.peak_running * blocks_per_sequence <= pool_blocks
            assert row.paged.output_tokens == row.batch_size * TINY.memory_output_len


def test_a_failed_slab_allocation_is_reported_not_raised(setup: SeedSetup, monkeypatch: Any) -> None:
    """On a GPU the contiguous slabs are allocated until the allocation fails: that failure is a row."""
    import tokenmill.runner.kv_cache as kv_cache

    real = kv_cache.allocate_kv_pool

    def allocate(num_layers: int, num_blocks: int, *args: Any) -> Any:
        if num_blocks >= 4 and args[0] == CONTEXT:  # contiguous slabs of 4 sequences or more
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(num_layers, num_blocks, *args)

    monkeypatch.setattr(kv_cache, "allocate_kv_pool", allocate)
    sizes = replace(TINY, memory_batch_sizes=(2, 4, 8), kv_limit_gib=1.0)
    table = in_thread(lambda: measure_kv_memory(replace(setup, sizes=sizes)))
    assert table.contiguous_oom() == 4
    failures = [row.contiguous_failure for row in table.rows]
    assert failures[0] == "" and "CUDA out of memory" in failures[1] and "batch 4" in failures[2]


def watch_running(engine: LLMEngine) -> list[int]:
    """Patch the engine to record how many sequences run after each step."""
    running: list[int] = []
    step = engine.step

    def watched_step() -> Any:
        deltas = step()
        running.append(engine.num_running)
        return deltas

    engine.step = watched_step  # type: ignore[method-assign]
    return running


def test_serving_keeps_the_users_requests_in_flight(setup: SeedSetup) -> None:
    users = 3
    workload = fixed_workload(setup, 5, TINY.serve_input_len, TINY.serve_output_len)

    def watched(engine: LLMEngine) -> tuple[list[int], LoadRun]:
        running = watch_running(engine)
        return running, in_thread(lambda: closed_loop(engine, workload, users))

    for batching, at_once in ((SEQUENTIAL, 1), (BATCHED, users)):
        running, run = run_on_engine(setup, setup.config(batching=batching, max_num_seqs=users), watched)
        assert max(running) == at_once, batching
        assert run.num_requests == len(run.latencies_s) == 5
        assert run.output_tokens == 5 * TINY.serve_output_len
        assert run.requests_per_s == pytest.approx(5 / run.elapsed_s)


def test_bad_flags_answer_without_importing_torch() -> None:
    for argv, message in (
        (["--tables", "nope"], "unknown table 'nope'"),
        (["--gen-lens", "8,4"], "ascending"),
        (["--users", "0"], "at least 1"),
        (["--paged-pool-gib", "x"], "expected a number"),
    ):
        result = run_cli("bench", "seeds", *argv)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "imported: nothing heavy" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_command_writes_every_table_beside_the_seed(tiny_gpt2_folder: Path, tmp_path: Path) -> None:
    argv = ["--model", str(tiny_gpt2_folder), "--quick", "--threads", "1", "--report-dir", str(tmp_path),
            "--context-len", "256", "--gen-lens", "4,8", "--prompt-lens", "8", "--prompt-gen-len", "4",
            "--batch-sizes", "1,2", "--memory-batch-sizes", "1,2,4", "--kv-limit-gib", "0.001",
            "--paged-pool-gib", "0.0001", "--users", "1,2", "--min-requests", "2"]  # fmt: skip
    assert in_thread(lambda: command.main(argv)) == 0
    report = (tmp_path / "seeds.md").read_text()
    assert report.startswith("- commit: ") and report.splitlines()[1].startswith("- command: ")
    assert "from another machine (A100, seed's README)" in report and "correctness passed" in report
    for heading in ("## 1. KV cache", "## 2. Batch-size", "## 3. Contiguous vs paged", "## 4. Serving"):
        assert heading in report
    assert "contiguous runs out of memory at batch 4" in report  # 4 slabs of 384 KiB > 1 MiB
    assert "Share of copy bandwidth" in report and report.count("of copy BW") == 2
    assert report.count("Seed (GPT-2 124M, float32, from another machine (A100, seed's README))") == 4
    if pyplot() is not None:
        assert (tmp_path / "seeds.png").stat().st_size > 0


def test_a_preset_name_loads_dummy_weights_and_a_folder_its_own(tiny_gpt2_folder: Path) -> None:
    assert command.model_and_format(None, "auto") == ("gpt2", "dummy")
    assert command.model_and_format("llama-3.2-1b", "auto") == ("llama-3.2-1b", "dummy")
    assert command.model_and_format(str(tiny_gpt2_folder), "auto") == (str(tiny_gpt2_folder), "auto")


def test_a_table_that_fails_is_reported_and_the_others_still_run(setup: SeedSetup, monkeypatch: Any) -> None:
    def fail(_: SeedSetup) -> None:
        raise RuntimeError("the kernel broke")

    monkeypatch.setattr(command, "measure_kv_speed", fail)
    tables = in_thread(lambda: command.measure_tables(setup, ("kv-cache", "serving")))
    assert tables.failures == {"kv-cache": "RuntimeError: the kernel broke"}
    assert [row.users for row in tables.serving] == list(TINY.users)
    text = render(tables, ["# intro"], "RSS")
    assert "## kv-cache: FAILED" in text and "## 4. Serving" in text and "## 1. KV cache" not in text


def test_the_presets_fit_gpt2s_context_and_a_request_too_long_is_named() -> None:
    for sizes in PRESETS.values():
        check_sizes(sizes)
        assert sizes.context_len <= 1024  # GPT-2's n_positions
    with pytest.raises(ValueError, match="a request of 1016 tokens does not fit --context-len 512"):
        check_sizes(replace(PRESETS["gpu"], context_len=512))


def test_allocating_until_it_fails_is_refused_on_cpu_before_loading() -> None:
    with pytest.raises(ValueError, match="is for a GPU"):
        command.main(["--device", "cpu", "--tables", "memory", "--kv-limit-gib", "0"])


def test_the_bandwidth_share_counts_the_weights_once_per_step_and_the_kv_per_sequence() -> None:
    roofline = Roofline(bandwidth_bytes_per_s=1000.0, weight_bytes=100, kv_bytes_per_token=4)
    # 10 tok/s at batch 2 is 5 steps/s, each reading 100 weight bytes + 2 sequences x 3 tokens x 4 bytes.
    assert roofline.share(10.0, 2, 3.0) == pytest.approx((100 + 2 * 3 * 4) * 5 / 1000)


def test_an_engine_is_gone_when_its_measurement_returns(setup: SeedSetup) -> None:
    """The next table's engine sizes its KV pool from the memory left: the last one must be collected by
    then (a ``with`` target in the tables' loops kept it alive; on a GPU the next engine found no room)."""
    import weakref

    engines: list[weakref.ref[LLMEngine]] = []
    assert run_on_engine(setup, setup.config(), lambda engine: engines.append(weakref.ref(engine))) is None
    assert engines and engines[0]() is None
