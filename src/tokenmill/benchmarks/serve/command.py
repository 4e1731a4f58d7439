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
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import httpx

from tokenmill.benchmarks.arguments import add_serve_arguments as add_arguments
from tokenmill.benchmarks.report import client_machine, provenance
from tokenmill.benchmarks.serve.client import (
    LevelResult,
    RequestRecord,
    Target,
    dataset_prompts,
    resolve_model,
    run_level,
    send_request,
    synthetic_prompts,
)
from tokenmill.benchmarks.serve.report import level_table, scaling_line, write_report


def _check_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")


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
    print(level_table(summaries))
    scaling = scaling_line(summaries)
    if scaling:
        print(scaling)
    if args.report_dir is not None:
        origin = provenance(client_machine())  # the client's: the server's hardware is not known here
        payload = {"provenance": origin.to_json(), **_payload(args, base_url, model, described, summaries)}
        payload["requests"] = {str(r.concurrency): [_record_dict(rec) for rec in r.records] for r in results}
        for path in write_report(args.report_dir, payload, summaries, origin):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def _payload(
    args: argparse.Namespace, base_url: str, model: str, described: str, summaries: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "url": base_url,
        "model": model,
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
