"""The load generator of ``bench serve``: prompts, one streamed ``/v1/completions`` request timed chunk by
chunk, and a level's records summarized (``levels`` runs a level)."""

import itertools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenmill.benchmarks.stats import mean, percentile

# Common English words: each is one token (with its leading space) in most BPE vocabularies, so a prompt of
# N of them is close to N tokens; the server's usage says exactly how many it counted.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her they this which be are have had "
    "not one all were we when there can an more if some time out so up said into than them only "
    "other new about these two may first then do any like my now over such our man me even most made "
    "after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three"
)
WORDS = _WORD_TEXT.split()
_MS = 1e3


@dataclass
class RequestRecord:
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    itls_s: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""  # the streamed completion

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LevelResult:
    concurrency: int
    duration_s: float
    records: list[RequestRecord]

    @property
    def completed(self) -> list[RequestRecord]:
        return [record for record in self.records if record.ok]

    def summary(self) -> dict[str, Any]:
        done = self.completed
        output_tokens = sum(record.output_tokens for record in done)
        prompt_tokens = sum(record.prompt_tokens or 0 for record in done)
        return {
            "concurrency": self.concurrency,
            "completed": len(done),
            "failed": len(self.records) - len(done),
            "duration_s": self.duration_s,
            "request_throughput": len(done) / self.duration_s,
            "output_throughput": output_tokens / self.duration_s,
            "total_token_throughput": (output_tokens + prompt_tokens) / self.duration_s,
            "mean_prompt_tokens": prompt_tokens / len(done) if done else math.nan,
            "mean_output_tokens": output_tokens / len(done) if done else math.nan,
            "ttft_ms": _stats([r.ttft_s for r in done if r.ttft_s is not None]),
            "tpot_ms": _stats([t for r in done if (t := r.tpot_s) is not None]),
            "itl_ms": _stats([itl for r in done for itl in r.itls_s]),
            "e2e_ms": _stats([r.latency_s for r in done]),
            "errors": sorted({r.error for r in self.records if r.error})[:5],
        }


def _stats(seconds: Sequence[float]) -> dict[str, float]:
    stats = {"mean": mean(seconds) * _MS}
    for q in (50, 90, 99):
        stats[f"p{q}"] = percentile(seconds, q) * _MS
    return stats


# -- prompts --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int


def synthetic_requests(
    count: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> list[BenchRequest]:
    """``count`` prompts of random words, their word counts and max_tokens drawn uniformly from the ranges."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        words = rng.randint(*input_len)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        requests.append(BenchRequest(prompt, rng.randint(*output_len)))
    return requests


def dataset_requests(path: Path, count: int, output_len: tuple[int, int], seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(prompt, rng.randint(*output_len)) for prompt in dataset_prompts(path, count)]


def dataset_prompts(path: Path, count: int) -> list[str]:
    """Prompts from a JSON-lines file (a "prompt" per line), cycled to ``count``."""
    prompts = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: expected a JSON object with a 'prompt'") from None
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(count)]


# -- one request ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    headers: dict[str, str]
    output_len: int
    ignore_eos: bool
    temperature: float

    def body(self, prompt: str | list[int], max_tokens: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens or self.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body.update(ignore_eos=True, min_tokens=max_tokens or self.output_len)
        return body


async def send_request(
    client: httpx.AsyncClient, target: Target, prompt: str | list[int], max_tokens: int | None = None
) -> RequestRecord:
    """Stream one completion of ``prompt`` (text, or token ids), timing every chunk that carries text."""
    start = time.perf_counter()
    chunk_times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        url = f"{target.base_url}/v1/completions"
        body = target.body(prompt, max_tokens)
        async with client.stream("POST", url, json=body, headers=target.headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestRecord(
                    False, time.perf_counter() - start, error=f"{response.status_code}: {text}"
                )
            async for event in _sse_events(response):
                if "error" in event:
                    return RequestRecord(False, time.perf_counter() - start, error=str(event["error"]))
                text = "".join(choice.get("text") or "" for choice in event.get("choices") or [])
                if text:
                    chunk_times.append(time.perf_counter())
                    pieces.append(text)
                usage = event.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestRecord(False, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
    return _record(start, chunk_times, usage, "".join(pieces))


async def _sse_events(response: httpx.Response) -> Any:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def _record(start: float, chunk_times: list[float], usage: dict[str, Any] | None, text: str) -> RequestRecord:
    output_tokens = int(usage["completion_tokens"]) if usage else len(chunk_times)
    prompt_tokens = int(usage["prompt_tokens"]) if usage else None
    return record_from_chunks(start, time.perf_counter(), chunk_times, prompt_tokens, output_tokens, text)


def record_from_chunks(
    start: float,
    end: float,
    chunk_times: list[float],
    prompt_tokens: int | None,
    output_tokens: int,
    text: str = "",
) -> RequestRecord:
    """A finished request from the times its text chunks arrived (``perf_counter`` seconds)."""
    if not chunk_times:
        return RequestRecord(False, end - start, error="the stream held no text")
    return RequestRecord(
        ok=True,
        latency_s=end - start,
        ttft_s=chunk_times[0] - start,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        itls_s=[b - a for a, b in itertools.pairwise(chunk_times)],
        text=text,
    )


# -- the server ----------------------------------------------------------------------------------------


def resolve_model(base_url: str, headers: dict[str, str], timeout_s: float) -> str:
    """The server's first model (``/v1/models``)."""
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])
