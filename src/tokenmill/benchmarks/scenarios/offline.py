"""The offline driver: a scenario served by an in-process ``LLMEngine``, no HTTP in between.

One loop: add every request whose release time has come, run one engine step, stamp each new token
with the time the step returned. A session's next turn is released when its previous answer's last
token arrives (plus the think time), with the whole history as its prompt. When nothing is running the
loop sleeps until the next release. The clock is injectable, so tests can run on a fake one.
"""

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.benchmarks.measure import on_fresh_engine, progress_bar
from tokenmill.benchmarks.scenarios.traces import RequestTrace, ScenarioRun
from tokenmill.benchmarks.scenarios.workloads import Scenario, Session
from tokenmill.benchmarks.workload import greedy_params
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel
from tokenmill.outputs import RequestDelta
from tokenmill.sampling_params import SamplingParams

WARMUP_TOKENS = 4


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Engine(Protocol):
    """What the driver uses of ``LLMEngine``."""

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> list[int]: ...

    def step(self) -> list[RequestDelta]: ...

    def has_unfinished_requests(self) -> bool: ...


@dataclass
class _Conversation:
    """A session in progress: the turn to send next and the history its prompt starts with."""

    session: Session
    next_turn: int = 0
    history: list[int] = field(default_factory=list)

    def next_prompt(self) -> list[int]:
        return self.history + self.session.turns[self.next_turn].user_token_ids


@dataclass
class _Releases:
    """Sessions waiting for their next turn's release time, earliest first."""

    queue: list[tuple[float, int, _Conversation]] = field(default_factory=list)
    _order: int = 0

    def push(self, time_s: float, conversation: _Conversation) -> None:
        heapq.heappush(self.queue, (time_s, self._order, conversation))
        self._order += 1

    def pop_due(self, now: float) -> list[tuple[float, _Conversation]]:
        due = []
        while self.queue and self.queue[0][0] <= now:
            release, _, conversation = heapq.heappop(self.queue)
            due.append((release, conversation))
        return due

    def next_time(self) -> float:
        return self.queue[0][0]


class OfflineDriver:
    def __init__(self, engine: Engine, scenario: Scenario, clock: Clock | None = None) -> None:
        self.engine = engine
        self.scenario = scenario
        self.clock = clock or WallClock()
        self.releases = _Releases()
        self.traces: list[RequestTrace] = []
        self.in_flight: dict[str, tuple[_Conversation, RequestTrace]] = {}
        for session in scenario.sessions:
            self.releases.push(session.arrival_time, _Conversation(session))

    def run(self, label: str, progress: Any = None) -> ScenarioRun:
        """Serve the whole scenario; ``progress`` (a tqdm bar or None) advances by output tokens."""
        start = self.clock.now()
        steps = 0
        while self.releases.queue or self.engine.has_unfinished_requests():
            for release, conversation in self.releases.pop_due(self.clock.now() - start):
                self._send(conversation, release)
            if not self.engine.has_unfinished_requests():
                self.clock.sleep(max(0.0, self.releases.next_time() - (self.clock.now() - start)))
                continue
            deltas = self.engine.step()
            steps += 1
            now = self.clock.now() - start
            for delta in deltas:
                self._record(delta, now)
                if progress is not None:
                    progress.update(len(delta.new_token_ids))
        return ScenarioRun(label, self.traces, self.clock.now() - start, steps)

    def _send(self, conversation: _Conversation, release: float) -> None:
        session, turn_index = conversation.session, conversation.next_turn
        request_id = session.request_id(turn_index)
        prompt = conversation.next_prompt()
        turn = session.turns[turn_index]
        self.engine.add_request(request_id, prompt, greedy_params(turn.output_len, ignore_eos=True))
        trace = RequestTrace(request_id, session.session_id, turn_index, prompt, release)
        self.traces.append(trace)
        self.in_flight[request_id] = (conversation, trace)

    def _record(self, delta: RequestDelta, now: float) -> None:
        conversation, trace = self.in_flight[delta.request_id]
        trace.token_times.extend([now] * len(delta.new_token_ids))
        trace.output_token_ids.extend(delta.new_token_ids)
        trace.num_output_tokens = len(trace.output_token_ids)
        trace.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            del self.in_flight[delta.request_id]
            if delta.finish_reason == "abort":
                trace.error = "aborted"
            self._continue(conversation, trace, now)

    def _continue(self, conversation: _Conversation, trace: RequestTrace, now: float) -> None:
        conversation.next_turn += 1
        if conversation.next_turn < len(conversation.session.turns):
            conversation.history = trace.prompt_token_ids + trace.output_token_ids
            self.releases.push(now + self.scenario.think_time_s, conversation)


# -- one measured config ----------------------------------------------------------------------------------


def warm_up(engine: Engine, scenario: Scenario) -> None:
    """Two requests run together first, a short and a long prompt, so one-time costs stay out of the
    timing."""
    params = greedy_params(WARMUP_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(scenario.warmup_prompts()):
        engine.add_request(f"warmup-{index}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def measure_offline(
    config: EngineConfig, loaded: LoadedModel, scenario: Scenario, label: str, show_progress: bool = True
) -> ScenarioRun:
    """Build an engine over ``loaded``, warm it up, run ``scenario``, then free the engine's KV pool."""

    def drive(engine: LLMEngine) -> ScenarioRun:
        warm_up(engine, scenario)
        with progress_bar(scenario.max_output_tokens, f"{scenario.name} {label}", show_progress) as bar:
            run = OfflineDriver(engine, scenario).run(label, progress=bar)
        run.extra["preemptions"] = engine.scheduler_stats().num_preemptions
        return run

    return on_fresh_engine(config, loaded, drive)
