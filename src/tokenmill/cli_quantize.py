"""``tokenmill quantize``: its flags (checked before torch is imported) and the command."""

import argparse


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="the float checkpoint: a Hugging Face folder, a .gguf file, an installed model's name or a "
        "hub id (default: the embedded default model)",
    )
    parser.add_argument("--output", required=True, help="the new folder to write the quantized checkpoint to")
    parser.add_argument(
        "--quantization", choices=["int8", "fp8"], default="int8", help="8-bit weight format (default: int8)"
    )
    parser.add_argument(
        "--rounding",
        choices=["gptq", "nearest"],
        default="gptq",
        help="gptq: each weight column's rounding error moved onto the later columns, against the inputs "
        "the model sees on calibration text (default); nearest: what --quantization does at load",
    )
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=4096,
        help="tokens of text the float model samples to calibrate on (default: 4096)",
    )
    parser.add_argument(
        "--device", default="auto", help="where the float model runs (default: auto, a GPU if there is one)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the calibration sampling (default: 0)")


def run_quantize(args: argparse.Namespace) -> int:
    from tokenmill.export import QuantizeOptions, write_quantized_checkpoint

    options = QuantizeOptions(
        fmt=args.quantization,
        rounding=args.rounding,
        calibration_tokens=args.calibration_tokens,
        seed=args.seed,
        device=args.device,
    )
    summary = write_quantized_checkpoint(args.model, args.output, options)
    print(
        f"wrote {summary.output}: {summary.quantized_tensors} projection weights as {options.fmt} "
        f"({options.rounding} rounding, {summary.calibration_tokens} calibration tokens) from "
        f"{summary.source} in {summary.seconds:.0f} s; load it with --model {summary.output}"
    )
    return 0
