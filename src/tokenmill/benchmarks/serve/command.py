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

The load generator (prompts, one streamed request, a concurrency level) is ``client``; the table, scaling
line and plot are ``report``; the options and the run are ``command``.
"""

import argparse
import asyncio
import json
import math
import multiprocessing
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from tokenmill.benchmarks.report import client_machine, detect_hardware, provenance
from tokenmill.benchmarks.serve.arguments import add_serve_arguments as add_arguments
from tokenmill.benchmarks.serve.client import (
    BenchRequest,
    LevelResult,
    RequestRecord,
    Target,
    dataset_requests,
    resolve_model,
    send_request,
    synthetic_requests,
)
from tokenmill.benchmarks.serve.levels import client_processes, run_level
from tokenmill.benchmarks.serve.report import comparison_table, level_table, scaling_line, write_report


class WarmUpError(RuntimeError):
    """The server answered the warm-up request with an error, so no level is run."""


def _check_args(args: argparse.Namespace) -> None:
    if len(args.num_prompts) not in (1, len(args.concurrency)):
        raise ValueError(
            f"--num-prompts gives {len(args.num_prompts)} counts for {len(args.concurrency)} "
            "concurrency levels: give one count, or one per level"
        )
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    for item in args.compare:
        label, sep, path = item.partition("=")
        if not (sep and label and Path(path).is_file()):
            raise ValueError(f"--compare {item!r}: expected LABEL=PATH to an existing serve.json")


def level_requests(args: argparse.Namespace) -> list[list[BenchRequest]]:
    """Each level's requests: the first ``count`` of one seeded list, so levels share their prompts."""
    counts = args.num_prompts * len(args.concurrency) if len(args.num_prompts) == 1 else args.num_prompts
    total = max(counts)
    if args.dataset is not None:
        requests = dataset_requests(args.dataset, total, args.output_len, args.seed)
    else:
        requests = synthetic_requests(total, args.input_len, args.output_len, args.seed)
    return [requests[:count] for count in counts]


async def warm_up(target: Target, prompt: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        for _ in range(args.warmup):
            warm = await send_request(client, target, prompt, max_tokens=4)
            if not warm.ok:
                raise WarmUpError(f"the warm-up request failed: {warm.error}")


def run_all(target: Target, levels: list[list[BenchRequest]], args: argparse.Namespace) -> list[LevelResult]:
    asyncio.run(warm_up(target, levels[0][0].prompt, args))
    processes = [client_processes(c, args.client_processes) for c in args.concurrency]
    results = []
    context = multiprocessing.get_context("spawn")  # the client processes need neither torch nor CUDA
    with ProcessPoolExecutor(max(processes), mp_context=context) as pool:
        for concurrency, requests, share in zip(args.concurrency, levels, processes, strict=True):
            result = run_level(
                target, requests, concurrency, args.request_rate, args.seed, args.timeout, pool, share
            )
            _print_level(result, share)
            results.append(result)
    return results


def run_offline(
    model: str, levels: list[list[BenchRequest]], args: argparse.Namespace
) -> tuple[list[LevelResult], str]:
    from tokenmill.benchmarks.serve.offline import OfflineSettings, run_offline_level
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model))
    print(engine.describe_startup(), file=sys.stderr)
    settings = OfflineSettings(args.ignore_eos, args.temperature)
    results = []
    for concurrency, requests in zip(args.concurrency, levels, strict=True):
        result = run_offline_level(engine, requests, concurrency, settings, str(concurrency))
        _print_level(result)
        results.append(result)
    return results, detect_hardware(engine.device).describe()


def _print_level(result: LevelResult, processes: int = 1) -> None:
    s = result.summary()
    clients = f" ({processes} client processes)" if processes > 1 else ""
    print(
        f"concurrency {s['concurrency']:>4}{clients}: {s['completed']} ok, {s['failed']} failed, "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms",
        file=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    levels = level_requests(args)
    if args.dataset is not None:
        described = f"prompts from {args.dataset}"
    else:
        described = f"synthetic prompts of {_range_text(args.input_len)} words"
    if args.offline is not None:
        where, model = "offline (the engine in this process, no server)", args.offline
        results, machine = run_offline(args.offline, levels, args)
    else:
        where = args.url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            model = args.model or resolve_model(where, headers, args.timeout)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            print(f"tokenmill bench serve: cannot list the models of {where}: {exc}", file=sys.stderr)
            return 1
        target = Target(where, model, headers, args.output_len[1], args.ignore_eos, args.temperature)
        try:
            results = run_all(target, levels, args)
        except WarmUpError as exc:
            print(f"tokenmill bench serve: {exc}", file=sys.stderr)
            return 1
        machine = _client_host()
    summaries = [result.summary() for result in results]
    print(level_table(summaries))
    comparisons = [_comparison(item, summaries) for item in args.compare]
    for table in comparisons:
        print(table)
    scaling = scaling_line(summaries)
    if scaling:
        print(scaling)
    if args.report_dir is not None:
        origin = provenance(machine)
        payload = {"provenance": origin.to_json(), **_payload(args, where, model, described, summaries)}
        payload["comparisons"] = comparisons
        payload["requests"] = {str(r.concurrency): [_record_dict(rec) for rec in r.records] for r in results}
        for path in write_report(args.report_dir, payload, summaries, origin):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def _client_host() -> str:
    """The client's machine; a server on another host is not described (one on this host uses its GPU)."""
    import torch

    host = client_machine()
    if torch.cuda.is_available():
        host += f"; this host's GPU: {detect_hardware(torch.device('cuda')).describe()}"
    return host


def _range_text(bounds: tuple[int, int]) -> str:
    low, high = bounds
    return str(low) if low == high else f"{low}-{high}"


def _comparison(item: str, summaries: list[dict[str, Any]]) -> str:
    label, _, path = item.partition("=")
    other = json.loads(Path(path).read_text())
    return comparison_table(label, summaries, other["levels"])


def _payload(
    args: argparse.Namespace, base_url: str, model: str, described: str, summaries: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "url": base_url,
        "model": model,
        "workload": {
            "num_prompts": args.num_prompts,
            "prompts": described,
            "input_len": _range_text(args.input_len),
            "output_len": _range_text(args.output_len),
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "concurrency": args.concurrency,
        },
        "levels": summaries,
    }


def _record_dict(record: RequestRecord) -> dict[str, Any]:
    data = asdict(record)
    data.pop("itls_s")
    data.pop("text")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(prog="tokenmill bench serve", description=doc.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
