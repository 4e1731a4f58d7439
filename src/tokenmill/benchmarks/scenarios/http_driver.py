"""The serve driver: a scenario sent over HTTP to an OpenAI-compatible server, through ``bench serve``'s
streaming client (``/v1/completions`` with token-id prompts, one timed chunk per piece of text).

The server is either one given by URL (any server that takes token-id prompts and has ``/tokenize``, such
as tokenmill's or vLLM's), or tokenmill's own started in this process for each config, on a free port, over
the already-loaded model, so the feature can be compared off and on in one run. Each session is one
asyncio task: it waits for its arrival time, sends a turn, and for a multi-turn session tokenizes the
answer's text with the server's ``/tokenize`` to append it to the history it re-sends next.

This module imports httpx (and, for the in-process server, FastAPI and uvicorn); the offline driver does
not need it.
"""

import asyncio
import itertools
import time
from typing import Any

import httpx

from tokenmill.benchmarks.measure import on_fresh_engine, progress_bar
from tokenmill.benchmarks.scenarios.offline import WARMUP_TOKENS
from tokenmill.benchmarks.scenarios.traces import RequestTrace, ScenarioRun
from tokenmill.benchmarks.scenarios.workloads import Scenario, Session
from tokenmill.benchmarks.serve import client as serve_client
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel

SERVED_MODEL_NAME = "tokenmill-scenario"


class RemoteTokenizer:
    """A server's ``/tokenize`` as a ``TextEncoder``: prompts built for a server use its own tokenizer."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str], timeout_s: float) -> None:
        self.base_url, self.model, self.headers, self.timeout_s = base_url, model, headers, timeout_s

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        response = httpx.post(
            f"{self.base_url}/tokenize", json=body, headers=self.headers, timeout=self.timeout_s
        )
        response.raise_for_status()
        return [int(token) for token in response.json()["tokens"]]


async def tokenize_async(client: httpx.AsyncClient, target: serve_client.Target, text: str) -> list[int]:
    body = {"model": target.model, "prompt": text, "add_special_tokens": False}
    response = await client.post(f"{target.base_url}/tokenize", json=body, headers=target.headers)
    response.raise_for_status()
    return [int(token) for token in response.json()["tokens"]]


def greedy_target(base_url: str, model: str, headers: dict[str, str]) -> serve_client.Target:
    """Greedy, exactly ``max_tokens`` tokens (ignore_eos): the same requests as the offline driver's."""
    return serve_client.Target(base_url, model, headers, output_len=1, ignore_eos=True, temperature=0.0)


# -- one run ----------------------------------------------------------------------------------------------


class HttpDriver:
    def __init__(self, target: serve_client.Target, scenario: Scenario, timeout_s: float) -> None:
        self.target = target
        self.scenario = scenario
        self.timeout_s = timeout_s
        self.traces: list[RequestTrace] = []
        self.start = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    async def run(self, label: str, progress: Any = None) -> ScenarioRun:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=self.timeout_s) as client:
            await self._warm_up(client)
            self.start = time.perf_counter()
            await asyncio.gather(*(self._session(client, s, progress) for s in self.scenario.sessions))
            duration = max((t.token_times[-1] for t in self.traces if t.ok), default=self.elapsed())
        self.traces.sort(key=lambda trace: (trace.release_time, trace.request_id))
        return ScenarioRun(label, self.traces, duration)

    async def _warm_up(self, client: httpx.AsyncClient) -> None:
        prompts = self.scenario.warmup_prompts()
        records = await asyncio.gather(
            *(serve_client.send_request(client, self.target, prompt, WARMUP_TOKENS) for prompt in prompts)
        )
        failed = [record.error for record in records if not record.ok]
        if failed:
            raise RuntimeError(f"the warm-up request failed: {failed[0]}")

    async def _session(self, client: httpx.AsyncClient, session: Session, progress: Any) -> None:
        await asyncio.sleep(max(0.0, session.arrival_time - self.elapsed()))
        history: list[int] = []
        for index, turn in enumerate(session.turns):
            prompt = history + turn.user_token_ids
            trace = await self._send(client, session, index, prompt, turn.output_len)
            if progress is not None:
                progress.update(trace.num_output_tokens)
            if not trace.ok or index + 1 == len(session.turns):
                return
            history = prompt + await tokenize_async(client, self.target, trace.output_text)
            await asyncio.sleep(self.scenario.think_time_s)

    async def _send(
        self, client: httpx.AsyncClient, session: Session, index: int, prompt: list[int], max_tokens: int
    ) -> RequestTrace:
        release = self.elapsed()
        record = await serve_client.send_request(client, self.target, prompt, max_tokens)
        trace = RequestTrace(session.request_id(index), session.session_id, index, prompt, release)
        trace.error = record.error if not record.ok else None
        if record.ok and record.ttft_s is not None:
            first = release + record.ttft_s
            trace.token_times = list(itertools.accumulate(record.itls_s, initial=first))
            trace.output_text = record.text
            trace.num_output_tokens = record.output_tokens
        self.traces.append(trace)
        return trace


def drive(
    target: serve_client.Target, scenario: Scenario, label: str, timeout_s: float, show_progress: bool
) -> ScenarioRun:
    with progress_bar(scenario.max_output_tokens, f"{scenario.name} {label}", show_progress) as bar:
        return asyncio.run(HttpDriver(target, scenario, timeout_s).run(label, progress=bar))


# -- servers ----------------------------------------------------------------------------------------------


def resolve_served_model(base_url: str, headers: dict[str, str], timeout_s: float) -> str:
    return serve_client.resolve_model(base_url, headers, timeout_s)


def measure_url(
    base_url: str, model: str, headers: dict[str, str], scenario: Scenario, timeout_s: float, show: bool
) -> ScenarioRun:
    return drive(greedy_target(base_url, model, headers), scenario, base_url, timeout_s, show)


def measure_in_process(
    config: EngineConfig,
    loaded: LoadedModel,
    scenario: Scenario,
    label: str,
    timeout_s: float,
    show_progress: bool = True,
) -> ScenarioRun:
    """tokenmill's server over ``loaded`` with ``config``, on a free local port, for this one run."""
    from tokenmill.server import ServerSettings, ServerThread, create_app

    if loaded.tokenizer is None:
        raise ValueError(
            "the serve driver needs a model with a tokenizer (the server streams text); this one has none "
            "(dummy weights): use --driver offline"
        )

    def serve_over_http(engine: LLMEngine) -> ScenarioRun:
        app = create_app(engine, ServerSettings(served_model_name=SERVED_MODEL_NAME))
        with ServerThread(app) as server:
            target = greedy_target(server.base_url, SERVED_MODEL_NAME, {})
            run = drive(target, scenario, label, timeout_s, show_progress)
        run.extra["preemptions"] = engine.scheduler_stats().num_preemptions
        return run

    return on_fresh_engine(config, loaded, serve_over_http)
