"""The benchmarks end to end on a tiny random Llama: reports written, correctness enforced."""

import argparse
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiny_models import save_tiny_model
from tokenmill.attention.triton_backend import TritonAttentionBackend
from tokenmill.benchmarks import hf_peer, ladder, latency, report, throughput
from tokenmill.benchmarks.correctness import LOGPROB_TOLERANCE, LOSSY_KV_TOLERANCE, check_fast_path
from tokenmill.benchmarks.measure import RunResult, compare_outputs, percentile, run_engine
from tokenmill.benchmarks.workload import WorkloadSpec, build_workload, corpus_slice, parse_length_range
from tokenmill.cli import main as cli_main
from tokenmill.config import FUSED_KERNEL_TOGGLES, PLAIN_PATH, EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kernels import interpreter_enabled
from tokenmill.loading import load_model

TINY_WORKLOAD = ["--num-requests", "4", "--no-progress"]
SMALL_KV = ["--cpu-kv-cache-gib", "0.01"]  # a small pool, whatever the workload
# Where the Triton kernels run: compiled on a GPU, else in the interpreter on CPU tensors.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny batched ops gain nothing from a second thread, and on a shared CPU it can stall them badly.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- workload --------------------------------------------------------------------------------------------


def test_workload_is_seeded_and_in_range() -> None:
    spec = WorkloadSpec(20, (3, 9), (2, 5), seed=7)
    first, again = build_workload(spec, None, 100), build_workload(spec, None, 100)
    assert first.requests == again.requests
    assert first.prompt_source == "random"
    assert all(3 <= len(r.prompt_token_ids) <= 9 and 2 <= r.output_len <= 5 for r in first.requests)
    assert all(0 <= t < 100 for r in first.requests for t in r.prompt_token_ids)
    assert build_workload(WorkloadSpec(20, (3, 9), (2, 5), seed=8), None, 100).requests != first.requests


class _WordTokenizer:
    """Stands in for a Tokenizer: one id per word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]


def test_text_prompts_are_slices_of_the_corpus() -> None:
    spec = WorkloadSpec(5, (10, 10), (4, 4), prompt_source="text")
    workload = build_workload(spec, _WordTokenizer(), 1000)  # type: ignore[arg-type]
    assert workload.prompt_source == "text"
    assert all(len(r.prompt_token_ids) == 10 for r in workload.requests)
    assert corpus_slice([1, 2, 3], 5, random.Random(0))[:3] in ([1, 2, 3], [2, 3, 1], [3, 1, 2])
    with pytest.raises(ValueError, match="tokenizer"):
        build_workload(spec, None, 1000)


def test_poisson_arrivals_increase() -> None:
    workload = build_workload(WorkloadSpec(6, (2, 2), (2, 2), request_rate=10.0), None, 50)
    times = [r.arrival_time for r in workload.requests]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0


def test_length_ranges_parse() -> None:
    assert parse_length_range("64") == (64, 64)
    assert parse_length_range("32-96") == parse_length_range("32:96") == (32, 96)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_length_range("9-3")


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


# -- the HF peer ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["llama3", "gpt2"])  # fused qkv/gate_up; transposed Conv1D
def test_dummy_weights_copied_into_hf_give_the_same_tokens(architecture: str, tmp_path: Path) -> None:
    save_tiny_model(architecture, tmp_path)
    loaded = load_model(tmp_path / "config.json", load_format="dummy", seed=3)
    workload = build_workload(WorkloadSpec(3, (4, 12), (3, 8)), None, loaded.config.vocab_size)
    config = EngineConfig().with_options(device="cpu", max_model_len=64, num_kv_blocks=32)
    ours = run_engine(LLMEngine(config, loaded=loaded), workload, "ours")
    peer = hf_peer.build_hf_peer(loaded)
    theirs = peer.run_static(workload, batch_size=2)
    assert compare_outputs(ours, theirs) == []
    assert theirs.num_output_tokens == workload.max_output_tokens


def test_missing_continuous_batching_is_reported_not_crashed() -> None:
    peer = hf_peer.HFPeer(object(), torch.device("cpu"), 0, (), "stub")
    workload = build_workload(WorkloadSpec(1, (2, 2), (2, 2)), None, 10)
    assert not peer.has_continuous_batching()
    with pytest.raises(hf_peer.PeerUnavailableError):
        peer.run_continuous(workload)


# -- ladder ------------------------------------------------------------------------------------------------


def _ladder_args(folder: Path, report_dir: Path | None) -> list[str]:
    """The CPU's ladder (its rungs, its report folder), on a GPU host too."""
    ranges = ["--input-len-range", "4-12", "--output-len-range", "3-8", "--batch-size", "2"]
    where = [] if report_dir is None else ["--report-dir", str(report_dir)]
    return ["--model", str(folder), "--device", "cpu", *TINY_WORKLOAD, *ranges, *where]


def test_ladder_reports_every_rung(
    tiny_llama_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv(report.REPORT_DIR_ENV, str(tmp_path))  # no --report-dir: the default folder
    assert ladder.main(_ladder_args(tiny_llama_folder, None)) == 0
    folder = tmp_path / "ladder-cpu"
    assert {p.name for p in folder.iterdir()} >= {"ladder.md", "ladder.json", "ladder.png"}
    markdown = (folder / "ladder.md").read_text()
    cpu_rungs = [rung for rung in ladder.RUNGS if not rung.cuda_only]  # Triton / CUDA graph rungs skipped
    for rung in cpu_rungs:  # numbered by their place on the whole ladder
        assert f"| {ladder.RUNGS.index(rung) + 1}. {rung.name} " in markdown
    assert (
        "HF generate (batch 2)" in markdown
        and "workload:" in markdown
        and "![ladder](ladder.png)" in markdown
    )
    assert markdown.startswith("- commit: ") and "\n- machine: " in markdown and "\n- date: " in markdown
    written = json.loads((folder / "ladder.json").read_text())
    assert [r["name"] for r in written["rungs"]] == [rung.name for rung in cpu_rungs]
    assert written["hf_matching_requests"] == 4 and written["provenance"]["machine"]
    assert written["rungs"][0]["peak_kv_reserved_bytes"] == 0 and written["rungs"][1]["kv_pool_bytes"] > 0
    out = capsys.readouterr().out
    assert "every rung's greedy tokens equal those of 'recompute'" in out and f"to {folder}" in out


def test_gpu_rungs_each_add_one_fast_path_toggle_to_the_paged_rung() -> None:
    setup = ladder.LadderSetup(batch_size=8, num_requests=32, max_model_len=192, block_size=16)
    base = EngineConfig().with_options(**PLAIN_PATH)  # as the ladder command starts
    configs = {rung.name: config for rung, config in ladder.rung_configs(base, setup, ladder.RUNGS)}
    paged, triton = configs["paged KV"], configs["Triton attention"]
    assert (paged.kernels.attention_backend, triton.kernels.attention_backend) == ("torch", "triton")
    assert not any(triton.option(name) for name in FUSED_KERNEL_TOGGLES)
    assert all(configs["fused kernels"].option(name) for name in FUSED_KERNEL_TOGGLES)
    assert not configs["fused kernels"].graphs.enabled and configs["CUDA graphs"].graphs.enabled
    assert configs["logits in graphs"].graphs.logits and not configs["CUDA graphs"].graphs.logits
    overlapped, logits = configs["overlapped decode"].graphs, configs["logits in graphs"].graphs
    assert overlapped.overlap_decode and not logits.overlap_decode


def test_paged_rung_keeps_the_contiguous_kv_budget() -> None:
    setup = ladder.LadderSetup(batch_size=8, num_requests=32, max_model_len=192, block_size=16)
    configs = {rung.name: config for rung, config in ladder.rung_configs(EngineConfig(), setup, ladder.RUNGS)}
    paged = configs["paged KV"]
    assert paged.kv.mode == "paged" and paged.scheduler.batching == "continuous"
    assert paged.kv.num_blocks is not None and paged.kv.num_blocks * 16 == 8 * 192
    assert paged.scheduler.max_num_seqs == 32
    assert configs["static batching"].scheduler.max_num_seqs == 8 and configs["recompute"].kv.mode == "none"


def test_ladder_refuses_to_report_a_rung_that_changed_the_tokens(
    tiny_llama_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    measure = ladder.command.measure_rung

    def broken(name: str, *args: Any) -> RunResult:
        result = measure(name, *args)
        if name == "paged KV":
            result.output_token_ids["req-1"][-1] += 1
        return result

    monkeypatch.setattr(ladder.command, "measure_rung", broken)
    argv = [*_ladder_args(tiny_llama_folder, tmp_path), "--skip-hf", "--rungs", "recompute", "paged KV"]
    assert ladder.main(argv) != 0
    assert not (tmp_path / "ladder.md").exists()
    error = capsys.readouterr().err
    assert "CORRECTNESS CHECK FAILED" in error and "paged KV" in error and "req-1" in error


# -- provenance and where reports go ---------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def test_reports_default_outside_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root, with nothing set, a benchmark writes nowhere in the repository (so not
    over the committed reports/); TOKENMILL_REPORT_DIR moves the default; --report-dir wins over both."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv(report.REPORT_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    default = report.report_dir(None, "ladder-cpu").resolve()
    assert not default.is_relative_to(REPO) and not default.is_relative_to(Path.cwd().resolve())
    assert default.name == "ladder-cpu"
    monkeypatch.setenv(report.REPORT_DIR_ENV, "/somewhere/reports")
    assert report.report_dir(None, "ladder-cpu") == Path("/somewhere/reports/ladder-cpu")
    assert report.report_dir(Path("reports/ladder-cpu"), "ladder-cpu") == Path("reports/ladder-cpu")
    parser = argparse.ArgumentParser()
    ladder.add_arguments(parser)
    assert parser.parse_args([]).report_dir is None  # no folder of its own: the default above


def _repository_state() -> str:
    """Every file git sees in the repository, committed or not (ignored ones aside), with its status."""
    run = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the git checkout")
def test_tokenmill_bench_ladder_from_the_repository_root_writes_nowhere_in_it(
    tiny_llama_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """As the README runs it, from the repository root with nothing set: the report lands in the user's
    cache folder, and the repository (its committed reports/ included) is left as it was."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv(report.REPORT_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    before = _repository_state()
    argv = ["bench", "ladder", *_ladder_args(tiny_llama_folder, None), "--skip-hf", "--rungs", "recompute"]
    assert cli_main(argv) == 0
    assert _repository_state() == before
    written = tmp_path / "cache" / "tokenmill" / "reports" / "ladder-cpu"
    assert {"ladder.md", "ladder.json"} <= {path.name for path in written.iterdir()}
    assert f"to {written}" in capsys.readouterr().out


def test_provenance_names_commit_command_machine_and_date() -> None:
    hardware = report.Hardware("cpu", "Test CPU", "1 core")
    header = report.provenance_header(
        hardware, ["/usr/bin/tokenmill", "bench", "ladder", "--rungs", "paged KV"]
    )
    lines = header.splitlines()
    assert lines[0].startswith("- commit: ") and lines[0] != "- commit: "
    assert lines[1] == "- command: `tokenmill bench ladder --rungs 'paged KV'`"
    assert lines[2] == f"- machine: {hardware.describe()}" and lines[3].startswith("- date: 20")
    assert header.endswith("\n\n")
    commit = lines[0].removeprefix("- commit: ")
    if Path(report.__file__).resolve().is_relative_to(REPO) and (REPO / ".git").exists():
        # tokenmill runs from this checkout: the short hash of HEAD, marked when the tree has changes
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        assert commit.removesuffix("+dirty") == head.stdout.strip()


def test_provenance_without_git_or_a_checkout_says_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert report.source_commit(tmp_path) == "unknown"  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert report.source_commit() == "unknown"
    assert report.provenance("a machine").commit == "unknown"
    monkeypatch.setenv("TOKENMILL_COMMIT", "abc1234")  # a shipped copy of the tree names its commit
    assert report.provenance("a machine").commit == "abc1234"


def test_kernels_benchmark_stamps_its_output_and_json(tmp_path: Path) -> None:
    """`bench kernels` (its smoke shapes, in the interpreter) prints the provenance header and keeps it
    in its JSON, as every other benchmark's report does."""
    out_json = tmp_path / "kernels.json"
    argv = ["--device", "cpu", "--smoke", "--dtype", "float32", "--only", "silu", "--no-gemv"]
    argv += ["--no-sampler", "--no-model", "--json", str(out_json)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "tokenmill.benchmarks.kernels", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("- commit: ") and "\n- machine: " in run.stdout
    stamp = json.loads(out_json.read_text())["provenance"]
    assert "tokenmill.benchmarks.kernels --device cpu --smoke" in stamp["command"]
    assert stamp["commit"] and stamp["date"] and "cpu" in stamp["machine"]


# -- latency and throughput --------------------------------------------------------------------------------


def test_latency_prints_both_engines_and_bandwidth(
    tiny_llama_folder: Path, tmp_path: Path, capsys: Any
) -> None:
    argv = ["--model", str(tiny_llama_folder), "--input-len", "8", "--output-len", "4", "--iters", "1"]
    assert latency.main([*argv, "--report-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tokenmill " in out and "HF generate " in out and "copy bandwidth" in out and "- machine: " in out
    assert "- commit: " in out and "- command: " in out
    report = (tmp_path / "latency.md").read_text()
    assert report.startswith("- commit: ") and "speed ratio tokenmill / HF" in report


def test_decode_bytes_count_the_lookup_table_once(tiny_llama_folder: Path) -> None:
    loaded = load_model(tiny_llama_folder)
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    table = loaded.model.model.embed_tokens.weight
    untied_lookup = (table.shape[0] - 1) * table.shape[1] * table.element_size()
    assert latency.weight_bytes_read_per_token(loaded.model) == params - untied_lookup
    assert latency.bandwidth_share(100, 1.0, 400.0) == 0.25


def test_throughput_writes_its_report(tiny_llama_folder: Path, tmp_path: Path, capsys: Any) -> None:
    argv = [
        "--model",
        str(tiny_llama_folder),
        *TINY_WORKLOAD,
        "--random-range",
        "3",
        "9",
        "--ignore-eos",
        *SMALL_KV,
    ]
    assert throughput.main([*argv, "--hf-batch-size", "2", "--report-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tokenmill / HF generate (static, batch 2)" in out
    written = json.loads((tmp_path / "throughput.json").read_text())
    assert len(written["results"]) == 2 and written["results"][0]["output_tokens"] > 0
    assert (tmp_path / "throughput.md").read_text().startswith("- commit: ")


def test_throughput_repeat_reports_every_run_against_the_first(
    tiny_llama_folder: Path, tmp_path: Path, capsys: Any
) -> None:
    argv = ["--model", str(tiny_llama_folder), *TINY_WORKLOAD, "--input-len", "5", "--output-len", "4"]
    argv += ["--skip-hf", "--repeat", "3", "--report-dir", str(tmp_path), *SMALL_KV]
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tokenmill")]
    assert [row.split("|")[1].strip().rsplit(", ", 1)[1] for row in rows] == ["run 1", "run 2", "run 3"]
    requests = TINY_WORKLOAD[TINY_WORKLOAD.index("--num-requests") + 1]
    assert all(row.rstrip(" |").endswith(f"{requests}/{requests}") for row in rows)  # same tokens each run
    written = json.loads((tmp_path / "throughput.json").read_text())["results"]
    first, later = written[0]["output_tokens_per_s"], [r["output_tokens_per_s"] for r in written[1:]]
    assert f"first run / best later run (fresh engines, one process): {first / max(later):.3f}" in out


def test_throughput_refuses_when_batched_tokens_differ(
    tiny_llama_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    measure = throughput.measure_engine

    def broken(*args: Any) -> RunResult:
        result = measure(*args)
        if args[3] != "verify":
            result.output_token_ids["req-0"][0] += 1
        return result

    monkeypatch.setattr(throughput, "measure_engine", broken)
    argv = [
        "--model",
        str(tiny_llama_folder),
        *TINY_WORKLOAD,
        "--input-len",
        "5",
        "--output-len",
        "3",
        "--skip-hf",
        *SMALL_KV,
        "--dtype",
        "float32",  # the sequential re-run is float32's (a GPU's auto dtype, bfloat16, has none)
    ]
    assert throughput.main(argv) != 0
    assert "CORRECTNESS CHECK FAILED" in capsys.readouterr().err


# -- the correctness check every benchmark runs first ----------------------------------------------------


def test_fast_path_check_passes_for_triton_attention(tiny_llama_folder: Path) -> None:
    loaded = load_model(tiny_llama_folder, device=TRITON_DEVICE, dtype="float32")
    config = EngineConfig().with_options(
        device=TRITON_DEVICE, attention_backend="triton", num_kv_blocks=64, block_size=4
    )
    check = check_fast_path(config, loaded, [[5, 6, 7, 8, 9], [10, 11, 12], [13] * 9], max_tokens=6)
    assert check.passed, check.describe()
    assert check.toggles["attention_backend"] == "triton" and check.num_tokens == 18
    assert "passed" in check.describe()


def test_fast_path_check_catches_a_wrong_kernel(tiny_llama_folder: Path, monkeypatch: Any) -> None:
    loaded = load_model(tiny_llama_folder, device=TRITON_DEVICE, dtype="float32")
    real_forward = TritonAttentionBackend.forward

    def off_by_a_little(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return real_forward(self, *args, **kwargs) * 1.01

    monkeypatch.setattr(TritonAttentionBackend, "forward", off_by_a_little)
    config = EngineConfig().with_options(
        device=TRITON_DEVICE, attention_backend="triton", num_kv_blocks=64, block_size=4
    )
    check = check_fast_path(config, loaded, [[5, 6, 7, 8, 9], [10, 11, 12]], max_tokens=6)
    assert not check.passed and "FAILED" in check.describe()
    assert check.max_logprob_diff > LOGPROB_TOLERANCE


def test_fast_path_check_over_a_float8_kv_pool(tiny_llama_folder: Path, monkeypatch: Any) -> None:
    """Both paths round K/V to e4m3: logprobs agree within the lossy tolerance; a kernel far off fails."""
    loaded = load_model(tiny_llama_folder, device=TRITON_DEVICE, dtype="float32")
    config = EngineConfig().with_options(
        device=TRITON_DEVICE, attention_backend="triton", num_kv_blocks=64, block_size=4, kv_cache_dtype="fp8"
    )
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    check = check_fast_path(config, loaded, prompts, max_tokens=6)
    assert check.passed and check.tolerance == LOSSY_KV_TOLERANCE, check.describe()
    assert "float8 KV pool" in check.describe()
    real_forward = TritonAttentionBackend.forward

    def misreading(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:  # e.g. float8 bits misread
        return real_forward(self, *args, **kwargs) * 10

    monkeypatch.setattr(TritonAttentionBackend, "forward", misreading)
    assert not check_fast_path(config, loaded, prompts, max_tokens=6).passed
