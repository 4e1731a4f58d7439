"""What a driver records of a run, and the statistics the report shows.

Times are seconds since the run started. A request's ``token_times`` hold one entry per output token
(offline: the end of the engine step that produced it) or per streamed chunk of text (serve). TTFT runs
from the request's release (its arrival time, or for a later turn the moment the previous answer arrived)
to its first token; ITL is every gap between consecutive tokens (chunks) of one request.
"""

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.benchmarks.stats import mean, percentile

QUANTILES = (50, 90, 99)


@dataclass
class RequestTrace:
    request_id: str
    session_id: str
    turn: int
    prompt_token_ids: list[int]  # as sent
    release_time: float
    token_times: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)  # offline driver
    output_text: str = ""  # serve driver
    num_output_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (offline driver)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.release_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.release_time

    def output(self) -> list[int] | str:
        """What on/off runs must agree on: the token ids, or over HTTP the text."""
        return self.output_token_ids if self.output_token_ids else self.output_text


@dataclass
class ScenarioRun:
    label: str  # "off", "on", or a server's URL
    traces: list[RequestTrace]
    duration_s: float  # from the start to the last token
    num_steps: int | None = None  # engine steps (offline driver)
    extra: dict[str, Any] = field(default_factory=dict)

    def by_id(self) -> dict[str, RequestTrace]:
        return {trace.request_id: trace for trace in self.traces}


def quantiles(values: Sequence[float]) -> dict[str, float]:
    stats = {f"p{q}": percentile(values, q) for q in QUANTILES}
    stats["mean"] = mean(values)
    return stats


@dataclass(frozen=True)
class RunSummary:
    requests: int
    failed: int
    output_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int | None
    duration_s: float
    ttft_s: dict[str, float]
    itl_s: dict[str, float]
    latency_s: dict[str, float]

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def requests_per_s(self) -> float:
        return (self.requests - self.failed) / self.duration_s if self.duration_s > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "output_tokens_per_s": self.output_tokens_per_s,
            "requests_per_s": self.requests_per_s,
        }


def summarize(run: ScenarioRun) -> RunSummary:
    done = [trace for trace in run.traces if trace.ok]
    cached = [trace.num_cached_tokens for trace in done]
    return RunSummary(
        requests=len(run.traces),
        failed=len(run.traces) - len(done),
        output_tokens=sum(trace.num_output_tokens for trace in done),
        prompt_tokens=sum(len(trace.prompt_token_ids) for trace in done),
        cached_prompt_tokens=None if any(c is None for c in cached) else sum(c or 0 for c in cached),
        duration_s=run.duration_s,
        ttft_s=quantiles([trace.ttft for trace in done]),
        itl_s=quantiles([itl for trace in done for itl in trace.itls]),
        latency_s=quantiles([trace.latency for trace in done]),
    )
