"""The flags of ``tokenmill bench accuracy`` (no torch: the ``tokenmill`` command parses them first)."""

import argparse

from tokenmill.benchmarks.argument_types import positive_int, report_dir

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
        type=_mode_list,
        default=",".join(MODES),
        help=f"comma-separated quantized modes among {', '.join(MODES)} (default: all; gguf is skipped where "
        "the packed GGUF path is not built)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads on CPU")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=4096, help="tokens of the text scored (default: 4096)"
    )
    parser.add_argument("--window", type=positive_int, default=1024, help="tokens per teacher-forced window")
    parser.add_argument(
        "--greedy-tokens", type=positive_int, default=32, help="greedy tokens per prompt (default: 32)"
    )
    parser.add_argument("--report-dir", type=report_dir, default=None, help="also write accuracy.md here")


def _mode_list(text: str) -> str:
    """The modes, each once, all known: checked before the float model is scored."""
    modes = list(dict.fromkeys(mode.strip() for mode in text.split(",") if mode.strip()))
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown or [text]}; known: {', '.join(MODES)}")
    return ",".join(modes)
