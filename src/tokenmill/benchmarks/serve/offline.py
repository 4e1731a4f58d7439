"""``bench serve --offline MODEL``: the same requests at the same concurrency, run through the engine in this
process instead of a server, so the difference between two reports is what HTTP, streaming and the event
loop cost.

A closed loop, like the HTTP client's semaphore: at most ``concurrency`` requests are in the engine; when
one finishes the next is added before the next step. A request's "chunks" are the engine steps that gave
it tokens, timed as the step returns, so TTFT, ITL and end-to-end latency mean what they mean for the
server (minus the network and the detokenized stream).
"""

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.benchmarks.serve.client import BenchRequest, LevelResult, RequestRecord, record_from_chunks
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestDelta
from tokenmill.sampling_params import SamplingParams


@dataclass
class _InFlight:
    sent: float
    prompt_tokens: int
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0


@dataclass(frozen=True)
class OfflineSettings:
    ignore_eos: bool
    temperature: float


def run_offline_level(
    engine: LLMEngine, requests: Sequence[BenchRequest], concurrency: int, settings: OfflineSettings, tag: str
) -> LevelResult:
    """Run ``requests`` with at most ``concurrency`` in the engine at once; one record per request."""
    waiting = deque(enumerate(requests))
    in_flight: dict[str, _InFlight] = {}
    records: list[RequestRecord] = []
    start = time.perf_counter()
    while waiting or in_flight:
        while waiting and len(in_flight) < concurrency:
            number, request = waiting.popleft()
            request_id = f"offline-{tag}-{number}"
            prompt_ids = engine.add_request(request_id, request.prompt, _params(request, settings))
            in_flight[request_id] = _InFlight(time.perf_counter(), len(prompt_ids))
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            finished = _track(in_flight[delta.request_id], delta, now)
            if finished is not None:
                records.append(finished)
                del in_flight[delta.request_id]
    return LevelResult(concurrency, time.perf_counter() - start, records)


def _params(request: BenchRequest, settings: OfflineSettings) -> SamplingParams:
    min_tokens = request.max_tokens if settings.ignore_eos else 0
    return SamplingParams(
        max_tokens=request.max_tokens,
        min_tokens=min_tokens,
        ignore_eos=settings.ignore_eos,
        temperature=settings.temperature,
    )


def _track(state: _InFlight, delta: RequestDelta, now: float) -> RequestRecord | None:
    """Note the step's tokens; the request's record once it finished."""
    if delta.new_token_ids:
        state.chunk_times.append(now)
        state.output_tokens = delta.num_output_tokens
    if delta.finish_reason is None:
        return None
    return record_from_chunks(state.sent, now, state.chunk_times, state.prompt_tokens, state.output_tokens)
