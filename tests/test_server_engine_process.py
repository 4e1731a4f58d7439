"""The server with its engine in a process of its own (``tokenmill serve``'s default): the features of the
server reach through the process boundary, and the boundary fails cleanly. A child killed mid-request
answers the request with an error that says so and leaves no process behind; a bad model path is one line
of error; Ctrl-C and a dead parent end the engine process."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import psutil
import pytest

from cli_helpers import SRC, run_cli
from engine_helpers import llm_for
from tokenmill.config import EngineConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import EngineClient, ServerSettings, ServerThread, create_app
from tokenmill.server.generation import ServerContext

MODEL = "smollm2-process"
OPTIONS: dict[str, Any] = {"device": "cpu", "dtype": "float32", "cpu_kv_cache_gib": 0.25}
OPTIONS |= {"max_model_len": 256, "max_num_seqs": 4}
STREAM = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}


def launch() -> EngineClient:
    return EngineClient.launch(EngineConfig().with_options(**OPTIONS))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(create_app(launch(), ServerSettings(served_model_name=MODEL))) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def context(server: ServerThread) -> ServerContext:
    ctx: ServerContext = server.app.state.context
    return ctx


def post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def metric(server: ServerThread, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not in /metrics"
    return values[0]


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_the_engine_runs_in_another_process(server: ServerThread) -> None:
    ctx = context(server)
    assert ctx.engine is None and isinstance(ctx.engine_loop, EngineClient)
    pid = ctx.engine_loop.pid
    assert pid is not None and pid != os.getpid() and psutil.pid_exists(pid)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_greedy_answers_equal_the_offline_engine(smollm2, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12)
    offline = llm_for(smollm2, max_model_len=256).generate(prompts, params)
    for prompt, expected in zip(prompts, offline, strict=True):
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert answer.choices[0].text == expected.outputs[0].text
        assert answer.usage is not None and answer.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streamed_n2_chat_with_logprobs_equals_the_whole_answer(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Name a colour."}]
    options: Any = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
    options |= {"n": 2, "logprobs": True}
    whole = client.chat.completions.create(**options)
    texts = ["", ""]
    logprobs: list[list[float]] = [[], []]
    for chunk in client.chat.completions.create(**options, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            entries = (choice.logprobs.content if choice.logprobs else None) or []
            logprobs[choice.index] += [entry.logprob for entry in entries]
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        assert choice.logprobs is not None and choice.logprobs.content is not None
        expected = [entry.logprob for entry in choice.logprobs.content]
        assert logprobs[choice.index] == pytest.approx(expected, abs=1e-3)


def test_echo_stop_strings_and_prompt_logprobs(server: ServerThread, client: openai.OpenAI) -> None:
    prompt = "One, two, three, four,"
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(prompt)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    stop = full.strip()[:3]
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert stop not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}
    answer = post(server, "/v1/completions", body).json()
    prompt_logprobs = answer["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) > 1


def test_structured_output_and_a_bad_schema(server: ServerThread, client: openai.OpenAI) -> None:
    properties = {"n": {"type": "integer"}}
    schema = {"type": "object", "properties": properties, "required": ["n"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a number as JSON."}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert isinstance(json.loads(answer.choices[0].message.content or "")["n"], int)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "response_format": bad}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format.json_schema.schema"


def test_request_checks_and_engine_refusals_are_400s(server: ServerThread) -> None:
    refused = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "use_beam_search": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "use_beam_search"
    # Refused by the engine, in the other process: its message and parameter come back.
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": 3}
    priority = post(server, "/v1/completions", body)
    assert priority.status_code == 400 and priority.json()["error"]["param"] == "priority"
    too_long = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1000})
    assert too_long.status_code == 400 and "max_tokens" in too_long.json()["error"]["message"]
    tokens = post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 2 and tokens["max_model_len"] == 256


def test_metrics_come_from_the_engine_process(server: ServerThread, client: openai.OpenAI) -> None:
    before_tokens = metric(server, "tokenmill:generation_tokens_total")
    before_prompt = metric(server, "tokenmill:prompt_tokens_total")
    answer = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=6, temperature=0)
    assert answer.usage is not None
    generated = metric(server, "tokenmill:generation_tokens_total") - before_tokens
    assert generated == answer.usage.completion_tokens
    assert metric(server, "tokenmill:prompt_tokens_total") - before_prompt == answer.usage.prompt_tokens
    assert metric(server, "tokenmill:time_to_first_token_seconds_count") > 0
    assert metric(server, "tokenmill:iteration_tokens_total_count") > 0
    assert metric(server, "tokenmill:prefix_cache_queries_total") > 0
    assert metric(server, "tokenmill:num_requests_running") == 0


def test_a_disconnected_stream_is_aborted_in_the_engine(server: ServerThread) -> None:
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=STREAM, timeout=60) as response:
        next(response.iter_lines())
    wait_until(lambda: context(server).engine_loop.stats().num_running == 0)
    stats = context(server).engine_loop.stats()
    assert stats.kv_cache_usage == 0 and context(server).engine_loop.load()[1] == 0


def test_stream_interval_gathers_tokens(server: ServerThread) -> None:
    ctx = context(server)
    original = ctx.settings
    ctx.settings = replace(original, stream_interval=4)
    try:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 9, "stream": True, "ignore_eos": True}
        body |= {"return_token_ids": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
        counts = [len(json.loads(event)["choices"][0].get("token_ids") or []) for event in events]
        assert sum(counts) == 9 and max(counts) <= 4 and len([c for c in counts if c]) < 9
    finally:
        ctx.settings = original


# -- failures of the process ----------------------------------------------------------------------


def test_a_killed_engine_fails_its_requests_and_health() -> None:
    engine = launch()
    with ServerThread(create_app(engine, ServerSettings(served_model_name=MODEL))) as server:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=STREAM, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            pid = engine.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "the engine process died (exit code -9)" in error["message"] and error["code"] == 500
        assert not psutil.pid_exists(pid)
        health = httpx.get(f"{server.base_url}/health")
        assert health.status_code == 503 and "engine process died" in health.json()["reason"]
        later = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert later.status_code == 503


def test_stopping_the_server_ends_the_engine_process() -> None:
    engine = launch()
    with ServerThread(create_app(engine, ServerSettings(served_model_name=MODEL))):
        pid = engine.pid
        assert pid is not None and psutil.pid_exists(pid)
    assert not psutil.pid_exists(pid)


_ORPHAN = """
import os, sys
from tokenmill.config import EngineConfig
from tokenmill.server import EngineClient
if __name__ == "__main__":
    engine = EngineClient.launch(EngineConfig().with_options(**{options!r}))
    print(engine.pid, flush=True)
    os.kill(os.getpid(), 9)
"""


def test_the_engine_process_exits_when_its_parent_dies() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    script = _ORPHAN.format(options=OPTIONS)
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid = int(done.stdout.split()[0])
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10)


def test_a_bad_model_path_is_one_line_of_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = run_cli("serve", "--model", str(tmp_path / "no-such-model"), "--device", "cpu")
    assert done.returncode != 0
    assert "tokenmill: error:" in done.stderr and "no-such-model" in done.stderr
    assert "Traceback" not in done.stderr


def test_ctrl_c_stops_the_server_and_its_engine_process() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    options = ["--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "2", "--port", "0"]
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", *options],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert server.stderr is not None
    for line in server.stderr:
        if "Application startup complete" in line:
            break
    children = psutil.Process(server.pid).children()
    assert len(children) >= 1
    os.killpg(server.pid, signal.SIGINT)  # as a terminal does: the whole process group
    stderr = server.stderr.read()
    assert server.wait(30) in (0, 130), stderr  # 130: uvicorn re-raises the SIGINT it handled
    assert "Traceback" not in stderr
    psutil.wait_procs(children, timeout=10)
    assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)
