"""The flags of ``tokenmill bench tensor-parallel`` (no torch: ``tokenmill`` parses them first)."""

import argparse

from tokenmill.benchmarks.argument_types import report_dir
from tokenmill.config import EngineConfig  # imports no torch

DEFAULT_SECTIONS = ("correctness", "latency", "all-reduce", "throughput")
SECTIONS = (*DEFAULT_SECTIONS, "profile")  # profile: a diagnostic, asked for by name


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"tensor-parallel sizes must be at least 1, got {text!r}")
    return sizes if sizes[0] == 1 else [1, *sizes]  # every size is compared with 1


def _sections(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {unknown or text!r}; known: {', '.join(SECTIONS)}"
        )
    return names


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        try:
            EngineConfig().with_options(**{name: False})
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(f"--ablate {name}: {error}") from None
    return names


def add_tensor_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.1-8b", help="timed model: a preset with dummy weights")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--sizes", type=_sizes, default=[1, 2], help="tensor-parallel sizes (default: 1,2)")
    parser.add_argument(
        "--sections",
        type=_sections,
        default=list(DEFAULT_SECTIONS),
        help=f"comma-separated parts to run, of {', '.join(SECTIONS)} (default: all but profile)",
    )
    parser.add_argument(
        "--check-model",
        default="llama-3.2-1b",
        help="correctness: a preset whose dummy weights are written once as a float32 folder, so every size "
        "loads the same weights (default: llama-3.2-1b)",
    )
    parser.add_argument("--check-prompts", type=int, default=4, help="correctness prompts (default: 4)")
    parser.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per prompt (default: 32)")
    parser.add_argument("--input-len", type=int, default=128, help="latency: prompt tokens (default 128)")
    parser.add_argument("--output-len", type=int, default=256, help="latency: output tokens (default 256)")
    parser.add_argument("--iters", type=int, default=5, help="latency: measured runs (default 5)")
    parser.add_argument(
        "--num-requests", type=int, default=256, help="throughput: nano-vllm's workload (default 256)"
    )
    parser.add_argument(
        "--ablate",
        type=_names,
        default=[],
        help="latency: also run every size with each of these comma-separated on/off settings of the "
        "engine config off, one at a time (e.g. programmatic_launch,overlap_decode)",
    )
    parser.add_argument(
        "--profile-tokens",
        type=int,
        default=64,
        help="profile: tokens decoded under the profiler (default 64)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--report-dir", type=report_dir, default=None, help="also write tensor-parallel.md here"
    )
