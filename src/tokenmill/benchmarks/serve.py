"""Load test of an OpenAI-compatible server: streamed ``/v1/completions`` at several concurrency levels.

For each level, ``--num-prompts`` requests are sent with at most that many in flight (and, with
``--request-rate``, Poisson arrivals at that rate). Every request streams; the client records when each
text chunk arrives. Reported per level: request throughput, output tokens/s, and TTFT (time to the first
text), TPOT (time per output token after the first), ITL (time between chunks) and end-to-end latency, as
mean / p50 / p90 / p99. Output tokens come from the final chunk's usage (``stream_options.include_usage``)
or, where a server sends none, from the number of text chunks.

Works against any OpenAI-compatible server: ``ignore_eos`` / ``min_tokens`` are sent only with
``--ignore-eos``, as extra body fields that servers without them ignore.

    tokenmill serve &
    tokenmill bench serve --url http://127.0.0.1:8000 --concurrency 1,8,32 --num-prompts 64 \\
        --input-len 64 --output-len 64 --ignore-eos --report-dir reports/serve-cpu
"""

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

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
_WORDS = _WORD_TEXT.split()
_DEFAULT_CONCURRENCY = "1,8,32,128"
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


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats(seconds: Sequence[float]) -> dict[str, float]:
    mean = sum(seconds) / len(seconds) if seconds else math.nan
    stats = {"mean": mean * _MS}
    for q in (50, 90, 99):
        stats[f"p{q}"] = percentile(seconds, q) * _MS
    return stats


# -- prompts --------------------------------------------------------------------------------------------


def synthetic_prompts(count: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(count)]


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
    end = time.perf_counter()
    if not chunk_times:
        return RequestRecord(False, end - start, error="the stream held no text")
    output_tokens = int(usage["completion_tokens"]) if usage else len(chunk_times)
    return RequestRecord(
        ok=True,
        latency_s=end - start,
        ttft_s=chunk_times[0] - start,
        prompt_tokens=int(usage["prompt_tokens"]) if usage else None,
        output_tokens=output_tokens,
        itls_s=[b - a for a, b in itertools.pairwise(chunk_times)],
        text=text,
    )


# -- levels ---------------------------------------------------------------------------------------------


def arrival_offsets(count: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all at once, or Poisson at ``request_rate``."""
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def run_level(
    target: Target, prompts: Sequence[str], concurrency: int, request_rate: float, seed: int, timeout_s: float
) -> LevelResult:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:

        async def one(prompt: str, offset: float) -> RequestRecord:
            await asyncio.sleep(offset)
            async with semaphore:
                return await send_request(client, target, prompt)

        start = time.perf_counter()
        offsets = arrival_offsets(len(prompts), request_rate, seed)
        records = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets, strict=True)))
        return LevelResult(concurrency, time.perf_counter() - start, list(records))


async def run_all(target: Target, prompts: list[str], args: argparse.Namespace) -> list[LevelResult]:
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        for _ in range(args.warmup):
            warm = await send_request(client, target, prompts[0], max_tokens=min(4, target.output_len))
            if not warm.ok:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
    results = []
    for concurrency in args.concurrency:
        result = await run_level(target, prompts, concurrency, args.request_rate, args.seed, args.timeout)
        _print_level(result)
        results.append(result)
    return results


def _print_level(result: LevelResult) -> None:
    s = result.summary()
    print(
        f"concurrency {s['concurrency']:>4}: {s['completed']} ok, {s['failed']} failed, "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms",
        file=sys.stderr,
    )


# -- report ---------------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def markdown_table(summaries: Sequence[dict[str, Any]]) -> str:
    metrics = ("ttft_ms", "tpot_ms", "itl_ms")
    headers = ["concurrency", "ok / failed", "req/s", "output tok/s"]
    headers += [
        f"{m.split('_')[0].upper()} {stat} (ms)" for m in metrics for stat in ("mean", "p50", "p90", "p99")
    ]
    rows = []
    for s in summaries:
        row = [str(s["concurrency"]), f"{s['completed']} / {s['failed']}", _fmt(s["request_throughput"], 2)]
        row.append(_fmt(s["output_throughput"]))
        row += [_fmt(s[m][stat]) for m in metrics for stat in ("mean", "p50", "p90", "p99")]
        rows.append(row)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def scaling_line(summaries: Sequence[dict[str, Any]]) -> str | None:
    by_level = {s["concurrency"]: s["output_throughput"] for s in summaries}
    if 1 not in by_level or len(by_level) < 2 or not by_level[1]:
        return None
    top = max(by_level)
    return (
        f"Output tok/s at concurrency {top} is {by_level[top] / by_level[1]:.2f}x that at concurrency 1 "
        f"({by_level[top]:.1f} vs {by_level[1]:.1f})."
    )


def client_machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line
        ]
        name = names[0] if names else name
    return f"{name}, {cores} cores usable; Python {platform.python_version()}, {platform.system()}"


def write_report(report_dir: Path, payload: dict[str, Any], summaries: list[dict[str, Any]]) -> list[Path]:
    report_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (report_dir / f"serve.{ext}" for ext in ("json", "md", "png"))
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(_markdown(payload, summaries))
    written = [json_path, md_path]
    if plot(summaries, png_path, payload["model"]):
        written.append(png_path)
    return written


def _markdown(payload: dict[str, Any], summaries: list[dict[str, Any]]) -> str:
    workload = payload["workload"]
    lines = [
        "# tokenmill bench serve",
        "",
        f"- server: {payload['url']} (model `{payload['model']}`)",
        f"- workload: {workload['num_prompts']} prompts per level, {workload['prompts']}, "
        f"max_tokens {workload['output_len']}, ignore_eos {workload['ignore_eos']}, "
        f"temperature {workload['temperature']}, request rate {workload['request_rate']}",
        f"- client machine: {payload['client_machine']}",
        f"- date: {payload['date']}",
        "",
        markdown_table(summaries),
        "",
    ]
    scaling = scaling_line(summaries)
    if scaling:
        lines += [scaling, ""]
    return "\n".join(lines)


def plot(summaries: Sequence[dict[str, Any]], path: Path, model: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install 'tokenmill[bench]'): no plot", file=sys.stderr)
        return False
    levels = [s["concurrency"] for s in summaries]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(levels, [s["output_throughput"] for s in summaries], marker="o")
    left.set(xscale="log", xlabel="concurrency", ylabel="output tokens / s", title="Throughput")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        right.plot(levels, [s[key]["p50"] for s in summaries], marker="o", label=f"{label} p50")
    right.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="Latency (p50)")
    right.legend()
    for axes in (left, right):
        axes.set_xticks(levels, [str(level) for level in levels])
        axes.grid(alpha=0.3)
    figure.suptitle(f"tokenmill bench serve: {model}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


# -- command line ---------------------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got '{text}'")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)"
    )
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--concurrency", type=_levels, default=_levels(_DEFAULT_CONCURRENCY))
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default: all at once)"
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--input-len", type=int, default=64, help="words per synthetic prompt (~tokens)")
    parser.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--dataset", type=Path, default=None, help="JSON lines with a 'prompt' each")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="short requests sent before measuring")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--report-dir", type=Path, default=None, help="write serve.json / .md / .png here")


def _check_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")


def resolve_model(base_url: str, headers: dict[str, str], timeout_s: float) -> str:
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    base_url = args.url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or resolve_model(base_url, headers, args.timeout)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"tokenmill bench serve: cannot list the models of {base_url}: {exc}", file=sys.stderr)
        return 1
    if args.dataset is not None:
        prompts, described = dataset_prompts(args.dataset, args.num_prompts), f"prompts from {args.dataset}"
    else:
        prompts = synthetic_prompts(args.num_prompts, args.input_len, args.seed)
        described = f"synthetic prompts of {args.input_len} words"
    target = Target(base_url, model, headers, args.output_len, args.ignore_eos, args.temperature)
    results = asyncio.run(run_all(target, prompts, args))
    summaries = [result.summary() for result in results]
    print(markdown_table(summaries))
    scaling = scaling_line(summaries)
    if scaling:
        print(scaling)
    if args.report_dir is not None:
        payload = _payload(args, base_url, model, described, summaries, results)
        for path in write_report(args.report_dir, payload, summaries):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def _payload(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    described: str,
    summaries: list[dict[str, Any]],
    results: list[LevelResult],
) -> dict[str, Any]:
    return {
        "url": base_url,
        "model": model,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "client_machine": client_machine(),
        "workload": {
            "num_prompts": args.num_prompts,
            "prompts": described,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "concurrency": args.concurrency,
        },
        "levels": summaries,
        "requests": {str(r.concurrency): [_record_dict(record) for record in r.records] for r in results},
    }


def _record_dict(record: RequestRecord) -> dict[str, Any]:
    data = asdict(record)
    data.pop("itls_s")
    data.pop("text")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
