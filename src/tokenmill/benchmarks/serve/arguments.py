"""The flags of ``tokenmill bench serve`` (no torch: ``tokenmill`` parses them first)."""

import argparse
import math
import os
from pathlib import Path

from tokenmill.benchmarks.argument_types import positive_float, report_dir
from tokenmill.benchmarks.workload import parse_length_range

DEFAULT_CONCURRENCY = "1,8,32,128"


def _positive_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what} must be >= 1, got '{text}'")
    return values


def concurrency_levels(text: str) -> list[int]:
    return _positive_ints(text, "concurrency levels")


def prompt_counts(text: str) -> list[int]:
    return _positive_ints(text, "prompt counts")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)"
    )
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument(
        "--concurrency", type=concurrency_levels, default=concurrency_levels(DEFAULT_CONCURRENCY)
    )
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default: all at once)"
    )
    parser.add_argument(
        "--num-prompts",
        type=prompt_counts,
        default=[64],
        help="requests per concurrency level: one count, or one per level (comma-separated)",
    )
    parser.add_argument(
        "--input-len",
        type=parse_length_range,
        default=(64, 64),
        metavar="N|MIN-MAX",
        help="words per synthetic prompt (~tokens), or a range drawn uniformly per request",
    )
    parser.add_argument(
        "--output-len",
        type=parse_length_range,
        default=(64, 64),
        metavar="N|MIN-MAX",
        help="max_tokens of each request, or a range drawn uniformly per request",
    )
    parser.add_argument("--dataset", type=Path, default=None, help="JSON lines with a 'prompt' each")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="short requests sent before measuring")
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="client processes per level (default: one per 16 streams, at most half the cores)",
    )
    parser.add_argument(
        "--report-dir", type=report_dir, default=None, help="write serve.json / .md / .png here"
    )
    parser.add_argument(
        "--offline",
        metavar="MODEL",
        default=None,
        help="run the same requests in this process through the engine (its defaults) instead of a server",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="LABEL=SERVE_JSON",
        help="set this run beside another run's serve.json, level by level (repeatable)",
    )
