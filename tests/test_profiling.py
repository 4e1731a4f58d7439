"""The profiler on every rank (``profile_engine``) and the trace summary of ``bench tensor-parallel``'s
profile section, against a brute-force reference."""

import gzip
import json
import random
from pathlib import Path

import pytest

from tiny_models import save_tiny_model
from tokenmill.benchmarks.kernel_profile import Kernel, kind_of, profile_tables, summarize
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.profiling import profile_engine
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5)


def _generate(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request(f"r{random.random()}", prompt, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
    return tokens


def _op_names(path: Path) -> set[str]:
    with gzip.open(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    return {event.get("name", "") for event in events if event.get("ph") == "X"}


@pytest.mark.parametrize("tp", [1, 2])
def test_every_rank_writes_its_trace_and_the_engine_steps_on(tmp_path: Path, tp: int) -> None:
    save_tiny_model("llama3", tmp_path / "model")
    config = EngineConfig(model=str(tmp_path / "model")).with_options(
        device="cpu", tensor_parallel_size=tp, num_kv_blocks=64
    )
    engine = LLMEngine(config)
    try:
        before = _generate(engine, [5, 6, 7, 8])
        with profile_engine(engine, tmp_path / "traces") as traces:
            profiled = _generate(engine, [5, 6, 7, 8])
        after = _generate(engine, [5, 6, 7, 8])
    finally:
        engine.shutdown()
    assert before == profiled == after
    assert [path.name for path in traces] == [f"trace-rank{rank}.json.gz" for rank in range(tp)]
    for path in traces:  # every rank ran its shard of the MLP and of the attention while it was recorded
        names = _op_names(path)
        assert {"aten::silu", "aten::rsqrt"} <= names
        assert any("linear" in name or name in ("aten::mm", "aten::addmm") for name in names)


def _reference_busy_and_gaps(kernels: list[Kernel]) -> tuple[int, list[int]]:
    """Brute force on a 1 µs grid (integer spans): the covered instants, and each idle run's length."""
    end = max(int(k.start_us + k.duration_us) for k in kernels)
    covered = [False] * end
    for kernel in kernels:
        for instant in range(int(kernel.start_us), int(kernel.start_us + kernel.duration_us)):
            covered[instant] = True
    start = int(min(k.start_us for k in kernels))
    runs, length = [], 0
    for instant in range(start, end):
        if covered[instant]:
            if length:
                runs.append(length)
            length = 0
        else:
            length += 1
    return sum(covered), runs


def test_busy_time_and_gaps_match_a_brute_force_count() -> None:
    rng = random.Random(3)
    kernels = [
        Kernel(f"k{index}", float(rng.randrange(0, 2000)), float(rng.randrange(1, 60))) for index in range(80)
    ]
    summary = summarize(sorted(kernels, key=lambda k: k.start_us), rank=0)
    busy, runs = _reference_busy_and_gaps(kernels)
    assert summary.busy_us == busy
    assert summary.window_us == max(k.start_us + k.duration_us for k in kernels) - min(
        k.start_us for k in kernels
    )
    assert summary.gaps["< 2 µs"] == sum(run for run in runs if run < 2)
    assert summary.gaps["2-10 µs"] == sum(run for run in runs if 2 <= run < 10)
    assert summary.gaps["10-50 µs"] == sum(run for run in runs if 10 <= run < 50)
    assert summary.gaps["> 50 µs"] == sum(run for run in runs if run >= 50)
    assert sum(summary.gaps.values()) + busy == summary.window_us
    assert sum(total for _, total in summary.kinds.values()) == sum(k.duration_us for k in kernels)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-reduce"),
        ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 2>", "all-reduce"),
        ("ncclDevKernel_AllGather_RING_LL", "all-gather"),
        ("_gemv_kernel", "GEMV / GEMM"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "GEMV / GEMM"),
        ("_decode_kernel", "attention"),
        ("_rms_norm_kernel", "RMSNorm"),
        ("_gated_activation_kernel", "activation"),
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
    ],
)
def test_kernel_kinds_follow_their_names(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_profile_tables_give_each_rank_its_time_per_token() -> None:
    steps = 4
    ranks = [
        summarize(
            [
                Kernel("_gemv_kernel", 0.0, 100.0 + rank),
                Kernel("_push_all_reduce_kernel", 110.0, 6.0),
                Kernel("_gemv_kernel", 200.0, 100.0),
            ],
            rank,
        )
        for rank in range(2)
    ]
    text = "\n".join(profile_tables(ranks, steps, "TP=2"))
    assert "| rank 0 µs/token | rank 1 µs/token |" in text.replace("  ", " ").replace("  ", " ")
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
        for line in text.splitlines()
        if line.startswith("| ")
    }
    assert rows["window (first kernel to last)"] == ["75", "75"]  # 300 µs over 4 tokens
    assert rows["kernels: GEMV / GEMM"] == ["50 (0.5 calls)", "50 (0.5 calls)"]  # 200 (rank 0), 201 (rank 1)
    assert rows["kernels: all-reduce"] == ["2 (0.2 calls)", "2 (0.2 calls)"]
    assert rows["idle gaps > 50 µs"] == ["21", "21"]  # 84 µs (116 -> 200) over 4 tokens
    assert rows["median all-reduce kernel (µs, not per token)"] == ["6.0", "6.0"]
