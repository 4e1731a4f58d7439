"""``tokenmill bench scenarios``: workload shapes, the offline driver's timings on a fake clock, the on/off
statistics and targets, and whole runs (offline on a tiny random Llama, serve on the default model)."""

import ast
import importlib.util
import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_helpers import engine_for
from tokenmill.benchmarks.scenarios import command, compare, offline
from tokenmill.benchmarks.scenarios.sizes import CPU
from tokenmill.benchmarks.scenarios.traces import RequestTrace, ScenarioRun, summarize
from tokenmill.benchmarks.scenarios.workloads import (
    Scenario,
    Session,
    TokenSource,
    Turn,
    build_scenario,
    chunked_prefill,
    multi_turn,
    prefix_caching,
    token_source,
)
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel, load_model
from tokenmill.outputs import RequestDelta

VOCAB = 384  # the tiny models' vocabulary
RANDOM_TOKENS = TokenSource("random", [], VOCAB, None)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny(tiny_llama_folder: Path) -> LoadedModel:
    return load_model(tiny_llama_folder, dtype="float32")


def common_prefix_len(prompts: list[list[int]]) -> int:
    length = 0
    while all(len(p) > length and p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length


# -- workload shapes --------------------------------------------------------------------------------------


def test_prefix_caching_prompts_share_the_prefix_then_differ() -> None:
    sizes = replace(CPU, prefix_requests=48, prefix_len=1024, suffix_len=(32, 64))
    scenario = prefix_caching(sizes, RANDOM_TOKENS, seed=3)
    prompts = [session.turns[0].user_token_ids for session in scenario.sessions]
    assert len(prompts) == 48 and scenario.num_requests == 48
    shared = common_prefix_len(prompts)
    assert 1024 <= shared < 1024 + 16  # the suffixes' first 16 tokens never all agree
    assert len({tuple(p[1024:1040]) for p in prompts}) == 48  # every suffix starts its own way
    assert all(1024 + 32 <= len(p) <= 1024 + 64 for p in prompts)
    arrivals = [session.arrival_time for session in scenario.sessions]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_chunked_prefill_mixes_long_prompts_into_running_streams() -> None:
    sizes = replace(CPU, chunked_requests=16, long_fraction=0.75, long_input_len=300, stream_input_len=20)
    scenario = chunked_prefill(sizes, RANDOM_TOKENS, seed=1)
    longs = [s for s in scenario.sessions if len(s.turns[0].user_token_ids) == 300]
    streams = [s for s in scenario.sessions if len(s.turns[0].user_token_ids) == 20]
    assert len(longs) == 12 and len(streams) == 4 and len(scenario.sessions) == 16
    assert all(s.arrival_time == 0.0 and s.turns[0].output_len == sizes.stream_output_len for s in streams)
    long_arrivals = [s.arrival_time for s in longs]
    assert long_arrivals == sorted(long_arrivals) and long_arrivals[0] > 0  # they join running streams
    with pytest.raises(ValueError, match="each needs at least one"):
        chunked_prefill(replace(sizes, chunked_requests=2, long_fraction=0.9), RANDOM_TOKENS, seed=1)


def test_multi_turn_conversations_have_their_own_first_message() -> None:
    sizes = replace(CPU, conversations=5, turns=3, first_turn_len=40, turn_len=7, answer_len=5)
    scenario = multi_turn(sizes, RANDOM_TOKENS, seed=0)
    assert scenario.num_requests == 15
    assert [len(t.user_token_ids) for t in scenario.sessions[0].turns] == [40, 7, 7]
    assert len({tuple(s.turns[0].user_token_ids[:16]) for s in scenario.sessions}) == 5
    assert scenario.max_total_len == 40 + 7 + 7 + 3 * 5  # the last turn re-sends every answer


def test_every_workload_builds_from_corpus_text() -> None:
    class WordLengths:
        """Stands in for a tokenizer: one id per word, its length."""

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [len(word) for word in text.split()]

    source = token_source("auto", WordLengths(), VOCAB)
    assert source.kind == "text" and set(source.corpus_ids) <= set(range(1, 30))
    for name in command.WORKLOADS:
        scenario = build_scenario(name, replace(CPU, batching_requests=4), source, seed=0)
        prompts = [turn.user_token_ids for session in scenario.sessions for turn in session.turns]
        assert scenario.prompt_source == "text" and all(set(p) <= set(source.corpus_ids) for p in prompts)


# -- the offline driver on a fake clock -------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time += seconds


class OneSecondSteps:
    """The engine, with each step taking exactly one second of the fake clock."""

    def __init__(self, engine: LLMEngine, clock: FakeClock) -> None:
        self.engine, self.clock = engine, clock

    def add_request(self, request_id: str, prompt: Any, params: Any = None) -> list[int]:
        return self.engine.add_request(request_id, prompt, params)

    def step(self) -> list[RequestDelta]:
        self.clock.time += 1.0
        return self.engine.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()


def single_turns(*requests: tuple[str, float, int, int]) -> Scenario:
    """(id, arrival, prompt length, output length) each."""
    sessions = [
        Session(rid, arrival, [Turn(list(range(3, 3 + prompt_len)), output_len)])
        for rid, arrival, prompt_len, output_len in requests
    ]
    return Scenario("test", "test", sessions, "random")


def run_on_fake_clock(tiny: LoadedModel, scenario: Scenario, **options: Any) -> dict[str, RequestTrace]:
    clock = FakeClock()
    engine = OneSecondSteps(engine_for(tiny, max_model_len=128, **options), clock)
    run = offline.OfflineDriver(engine, scenario, clock).run("test")
    assert run.duration_s == clock.time
    return run.by_id()


@pytest.mark.parametrize(("batching", "c_ttft"), [("static", 6.0), ("continuous", 4.0)])
def test_offline_driver_times_tokens_at_their_steps(tiny: LoadedModel, batching: str, c_ttft: float) -> None:
    # a and b run together from t=0; c waits for a slot (static: the whole batch); d arrives at t=20, idle.
    scenario = single_turns(("a", 0.0, 5, 3), ("b", 0.0, 6, 5), ("c", 0.0, 4, 2), ("d", 20.0, 5, 2))
    traces = run_on_fake_clock(tiny, scenario, batching=batching, max_num_seqs=2)
    assert traces["a"].token_times == [1.0, 2.0, 3.0] and traces["b"].token_times == [1, 2, 3, 4, 5]
    assert traces["a"].ttft == 1.0 and traces["c"].ttft == c_ttft
    assert traces["d"].release_time == 20.0 and traces["d"].token_times == [21.0, 22.0]
    assert all(itl == 1.0 for trace in traces.values() for itl in trace.itls)
    assert [len(trace.output_token_ids) for trace in traces.values()] == [3, 5, 2, 2]


def test_ttft_runs_from_the_arrival_even_when_a_step_was_running(tiny: LoadedModel) -> None:
    # y arrives at 1.5, during the step that ends at 2; it is added then, and its first token comes at 3.
    traces = run_on_fake_clock(tiny, single_turns(("x", 0.0, 5, 4), ("y", 1.5, 5, 2)))
    assert traces["y"].release_time == 1.5 and traces["y"].token_times == [3.0, 4.0]
    assert traces["y"].ttft == 1.5


def test_chunked_prefill_ttft_counts_every_chunk_step(tiny: LoadedModel) -> None:
    scenario = single_turns(("long", 0.0, 40, 2))
    options = {"chunked_prefill": True, "max_num_batched_tokens": 16}
    assert run_on_fake_clock(tiny, scenario, **options)["long"].token_times == [3.0, 4.0]  # 16 + 16 + 8
    assert run_on_fake_clock(tiny, scenario)["long"].token_times == [1.0, 2.0]


def test_multi_turn_resends_the_growing_history_after_each_answer(tiny: LoadedModel) -> None:
    sizes = replace(
        CPU, conversations=2, turns=3, first_turn_len=12, turn_len=5, answer_len=4, think_time=0.5
    )
    scenario = multi_turn(sizes, RANDOM_TOKENS, seed=2)
    traces = run_on_fake_clock(tiny, scenario, kv_cache="paged", prefix_caching=True, block_size=4)
    for session in scenario.sessions:
        turns = [traces[session.request_id(k)] for k in range(3)]
        assert len(turns[0].prompt_token_ids) == 12
        for previous, current, turn in zip(turns, turns[1:], session.turns[1:], strict=False):
            history = previous.prompt_token_ids + previous.output_token_ids
            assert current.prompt_token_ids == history + turn.user_token_ids
            assert current.release_time == previous.token_times[-1] + 0.5
            assert current.num_cached_tokens is not None and current.num_cached_tokens >= 12  # prefix hit


# -- statistics and targets -------------------------------------------------------------------------------


def trace(rid: str, release: float, times: list[float]) -> RequestTrace:
    return RequestTrace(rid, rid, 0, [1, 2], release, times, list(range(len(times))), "", len(times))


def test_summary_statistics_and_on_off_ratios() -> None:
    off = ScenarioRun("off", [trace("a", 0.0, [2.0, 3.0, 4.0]), trace("b", 1.0, [5.0, 9.0])], 10.0)
    on = ScenarioRun("on", [trace("a", 0.0, [1.0, 2.0, 3.0]), trace("b", 1.0, [2.0, 3.0])], 5.0)
    s_off, s_on = summarize(off), summarize(on)
    assert (
        s_off.ttft_s["p50"] == 3.0 and s_off.itl_s["p50"] == 1.0 and s_off.itl_s["p99"] == pytest.approx(3.94)
    )
    assert s_off.output_tokens == 5 and s_off.output_tokens_per_s == 0.5 and s_off.requests_per_s == 0.2
    values = compare.ratios(s_off, s_on)
    assert values["output_tokens_per_s"] == 2.0 and values["ttft_p50"] == 1.0 / 3.0
    assert compare.compare_outputs(off, on) == []
    on.traces[1].output_token_ids[1] = 7
    (mismatch,) = compare.compare_outputs(off, on)
    assert mismatch.request_id == "b" and "position 1" in mismatch.description


def test_targets_are_judged_on_the_measured_numbers() -> None:
    steady = summarize(ScenarioRun("on", [trace("a", 0.0, [1.0, 2.0, 3.0, 4.5])], 4.5))
    stalled = summarize(ScenarioRun("off", [trace("a", 0.0, [1.0, 2.0, 3.0, 13.0])], 13.0))
    assert compare.itl_tail_target(stalled, steady).met
    assert not compare.itl_tail_target(steady, stalled).met
    slow_first = summarize(ScenarioRun("off", [trace("a", 0.0, [4.0, 5.0])], 5.0))
    fast_first = summarize(ScenarioRun("on", [trace("a", 0.0, [1.0, 2.0])], 2.0))
    assert compare.ttft_cut_target(slow_first, fast_first).met
    assert not compare.ttft_cut_target(fast_first, slow_first).met
    assert compare.check_target("burst", slow_first, fast_first) is None
    assert math.isnan(compare.ratio(1.0, 0.0))


# -- whole runs -------------------------------------------------------------------------------------------

TINY_SIZES = [
    "--batching-requests", "4", "--batching-rate", "200", "--max-num-seqs", "2",
    "--chunked-requests", "4", "--long-input-len", "48", "--long-rate", "200", "--stream-output-len", "8",
    "--chunk-budget", "16",
    "--prefix-requests", "4", "--prefix-len", "32", "--prefix-rate", "200",
    "--conversations", "2", "--turns", "2", "--first-turn-len", "16", "--turn-len", "4", "--answer-len", "3",
    "--conversation-rate", "200",
]  # fmt: skip


def tiny_args(folder: Path, report_dir: Path, *extra: str) -> list[str]:
    """On the CPU, a GPU host too: TINY_SIZES shrink the cpu preset (the gpu one's prompts outgrow the tiny
    model's 512 positions), and a CPU-sized KV pool serves them."""
    engine = ["--device", "cpu", "--cpu-kv-cache-gib", "0.01", "--block-size", "4"]
    return [
        "--model",
        str(folder),
        "--no-progress",
        *engine,
        *TINY_SIZES,
        "--report-dir",
        str(report_dir),
        *extra,
    ]


def test_a_tiny_run_reports_every_workload_off_and_on(
    tiny_llama_folder: Path, tmp_path: Path, capsys: Any
) -> None:
    assert command.main(tiny_args(tiny_llama_folder, tmp_path)) == 0
    report = json.loads((tmp_path / "scenarios.json").read_text())
    assert [w["workload"] for w in report["workloads"]] == list(command.WORKLOADS)
    for workload in report["workloads"]:
        assert workload["outputs_match"] and workload["mismatches"] == []
        off, on = workload["configs"]
        assert off["summary"]["failed"] == on["summary"]["failed"] == 0
        assert off["summary"]["output_tokens"] == on["summary"]["output_tokens"] > 0
        assert set(workload["on_over_off"]) >= {"ttft_p50", "itl_p99", "output_tokens_per_s"}
    by_name = {w["workload"]: w for w in report["workloads"]}
    configs = [c["engine_config"] for c in by_name["chunked_prefill"]["configs"]]
    assert [c["chunked_prefill"] for c in configs] == [False, True] and configs[1][
        "max_num_batched_tokens"
    ] == 16
    prefix_off, prefix_on = by_name["prefix_caching"]["configs"]
    assert prefix_off["summary"]["cached_prompt_tokens"] == 0 < prefix_on["summary"]["cached_prompt_tokens"]
    assert by_name["prefix_caching"]["target"]["target"].startswith("with prefix caching")
    markdown = (tmp_path / "scenarios.md").read_text()
    assert "| static " in markdown and "| continuous " in markdown and "| on / off " in markdown
    assert markdown.startswith("- commit: ") and "\n- machine: " in markdown and "baseline:" in markdown
    assert json.loads((tmp_path / "scenarios.json").read_text())["provenance"]["command"]
    assert all((tmp_path / f"{name}.png").is_file() for name in command.WORKLOADS)
    assert "greedy outputs identical off and on" in capsys.readouterr().out


def test_differing_outputs_are_reported_instead_of_numbers(
    tiny_llama_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    measure = offline.measure_offline

    def broken(*args: Any) -> ScenarioRun:
        run = measure(*args)
        if args[3] == "on":
            run.traces[0].output_token_ids[-1] += 1
        return run

    monkeypatch.setattr(offline, "measure_offline", broken)
    assert command.main(tiny_args(tiny_llama_folder, tmp_path, "--workload", "burst")) != 0
    assert "CORRECTNESS CHECK FAILED" in capsys.readouterr().err
    markdown = (tmp_path / "scenarios.md").read_text()
    assert "CORRECTNESS CHECK FAILED" in markdown and "| on / off " not in markdown
    assert not (tmp_path / "burst.png").exists()


def is_module(name: str) -> bool:
    """Whether ``name`` is a module (``from a.b import c`` may import a module ``a.b.c`` or a name in a.b)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def module_level_imports(module: str) -> set[str]:
    """The modules ``module`` imports when it is imported (not those imported inside functions)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if is_module(name)}


def imported_with(module: str) -> set[str]:
    """Every module a fresh import of ``module`` loads, following tokenmill's own modules and packages."""
    seen: set[str] = set()
    pending = [module]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if not name.startswith("tokenmill") or not is_module(name):
            continue
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        pending += [*parents, *module_level_imports(name)]
    return seen


def test_the_offline_driver_imports_no_http_module() -> None:
    # The GPU host may have no FastAPI, uvicorn or httpx: the offline path must not import them.
    offline_path = imported_with("tokenmill.benchmarks.scenarios.command") | imported_with(
        "tokenmill.benchmarks.scenarios.offline"
    )
    http = {"fastapi", "uvicorn", "httpx", "tokenmill.server"}
    # The serve benchmark's package and its flags (which every benchmark's parser takes) import no HTTP.
    serve_flags = {"tokenmill.benchmarks.serve", "tokenmill.benchmarks.serve.arguments"}
    serve_http = {name for name in offline_path if name.startswith("tokenmill.benchmarks.serve.")}
    serve_http -= serve_flags
    assert not {name for name in offline_path if name.split(".")[0] in http or name in http} | serve_http
    assert "httpx" in imported_with("tokenmill.benchmarks.scenarios.http_driver")  # the check sees imports


def test_serve_driver_runs_multi_turn_over_http(
    smollm2: LoadedModel, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(command.common, "load_for_args", lambda args: smollm2)
    sizes = ["--conversations", "2", "--turns", "2", "--first-turn-len", "12", "--turn-len", "4"]
    argv = ["--driver", "serve", "--workload", "multi_turn", "--no-progress", "--report-dir", str(tmp_path)]
    argv += [*sizes, "--answer-len", "3", "--conversation-rate", "100", "--cpu-kv-cache-gib", "0.05"]
    assert command.main(argv) == 0
    (workload,) = json.loads((tmp_path / "scenarios.json").read_text())["workloads"]
    assert workload["outputs_match"]
    for config in workload["configs"]:
        requests = {r["id"]: r for r in config["requests"]}
        for conversation in ("conv-0", "conv-1"):
            first, second = requests[f"{conversation}/turn-0"], requests[f"{conversation}/turn-1"]
            assert first["prompt_tokens"] == 12 and first["output_tokens"] == 3
            assert second["prompt_tokens"] > 12 + 4  # the first prompt, its answer and the new message
            assert second["release_s"] >= first["token_times_s"][-1]
