"""The flags of ``tokenmill bench accuracy`` (no torch: the ``tokenmill`` command parses them first)."""

import argparse
from pathlib import Path

DEFAULT_MODELS = "smollm2,gemma3-270m"
MODES = (
    "int8",
    "fp8",
    "fp8-w8a8",
    "int8-gptq",
    "fp8-gptq",
    "fp8-gptq-w8a8",
    "gguf-float32",
    "gguf-int16",
    "gguf-int8",
)


def add_accuracy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help=f"comma-separated models, each against its quantized modes (default: {DEFAULT_MODELS})",
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated quantized modes among {', '.join(MODES)} (default: all; gguf is skipped where "
        "the packed GGUF path is not built)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    parser.add_argument(
        "--max-tokens", type=int, default=4096, help="tokens of the text scored (default: 4096)"
    )
    parser.add_argument("--window", type=int, default=1024, help="tokens per teacher-forced window")
    parser.add_argument(
        "--greedy-tokens", type=int, default=32, help="greedy tokens per prompt (default: 32)"
    )
    parser.add_argument("--report-dir", type=Path, default=None, help="also write accuracy.md here")
