"""``tokenmill bench accuracy``: what each quantized mode costs in accuracy, measured on real models.

For each model (default: SmolLM2-135M, the embedded Q4_1 GGUF dequantized to float32, and Gemma 3 270M),
the unquantized model and each mode score the same text with teacher forcing (see :mod:`.measure`):

* ``int8``: per-channel symmetric int8 weights, weight-only (on CPU through ``_weight_int8pack_mm``);
* ``fp8``: per-channel e4m3 weights, weight-only (dequantized in PyTorch);
* ``fp8-w8a8``: the same weights with every projection's input rounded per token to e4m3 (dynamic
  scales), as a W8A8 GEMM computes, emulated in PyTorch;
* ``int8-gptq`` / ``fp8-gptq``: the int8 / fp8 formats with calibrated rounding: the model written by
  ``tokenmill quantize`` (GPTQ against text the float model samples, not the scored text) to a temporary
  folder and loaded from it as a pre-quantized checkpoint; ``fp8-gptq-w8a8``: those fp8 weights with the
  inputs rounded as ``fp8-w8a8`` rounds them;
* ``gguf-float32``: the GGUF blocks kept packed, when that path is built (skipped otherwise), float32
  inputs;
* ``gguf-int16`` / ``gguf-int8``: the same with each projection's input rounded to 16- / 8-bit integers
  per block of 32 and multiplied as integers (``gguf_activations``: int16 keeps float32's tokens,
  int8 is llama.cpp's rounding). The packed modes score through chunks of ``DECODE_CHUNK_TOKENS``, so
  that every position goes through the kernels a decode step runs.

Reported: perplexity and its change against the unquantized model, top-1 agreement (the share of text
positions whose argmax equals the unquantized model's), the targets of issue 18 (int8: perplexity within
1%, agreement >= 96%; fp8: within 3%, >= 90%), and the first ``--greedy-tokens`` greedy tokens of each
golden prompt compared with the unquantized model's.

    tokenmill bench accuracy --threads 2 --report-dir reports/accuracy-cpu
"""

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.benchmarks.accuracy.arguments import add_accuracy_arguments as add_arguments
from tokenmill.benchmarks.accuracy.measure import (
    CHUNK_TOKENS,
    DECODE_CHUNK_TOKENS,
    GreedyComparison,
    Scored,
    compare_greedy,
    greedy_continuations,
    linear_weight_bytes,
    score_text,
)
from tokenmill.benchmarks.accuracy.text import PROMPTS, TEXT_SOURCE, evaluation_text
from tokenmill.benchmarks.common import run_as_script
from tokenmill.benchmarks.report import (
    Hardware,
    detect_hardware,
    fmt_bytes,
    header_lines,
    markdown_table,
    provenance,
)
from tokenmill.errors import ModelLoadError
from tokenmill.export import QuantizeOptions, write_quantized_checkpoint
from tokenmill.kernels.options import KernelOptions
from tokenmill.loading import LoadedModel, load_model
from tokenmill.quantization import QuantizationConfig
from tokenmill.quantization.gptq import WeightFormat

MODE_CONFIGS: dict[str, QuantizationConfig | str] = {
    "int8": QuantizationConfig("int8"),
    "fp8": QuantizationConfig("fp8"),
    "fp8-w8a8": QuantizationConfig("fp8", dynamic_activations=True),
    "gguf-float32": "gguf",
    "gguf-int16": "gguf",
    "gguf-int8": "gguf",
}
# Modes written by ``tokenmill quantize`` with calibrated rounding, then loaded as published: the format,
# and whether the inputs are rounded as a W8A8 GEMM rounds them.
CALIBRATED_MODES: dict[str, tuple[WeightFormat, bool]] = {
    "int8-gptq": ("int8", False),
    "fp8-gptq": ("fp8", False),
    "fp8-gptq-w8a8": ("fp8", True),
}
# Modes that differ from another only in the kernels the model binds (the rest run plain PyTorch layers).
MODE_KERNELS: dict[str, KernelOptions] = {
    f"gguf-{inputs}": KernelOptions(gguf_packed=True, gguf_activations=inputs)
    for inputs in ("float32", "int16", "int8")
}
# (largest perplexity change, smallest top-1 agreement) from issue 18
TARGETS: dict[str, tuple[float, float]] = {
    "int8": (0.01, 0.96),
    "fp8": (0.03, 0.90),
    "fp8-w8a8": (0.03, 0.90),
    "int8-gptq": (0.01, 0.96),
    "fp8-gptq": (0.03, 0.90),
    "fp8-gptq-w8a8": (0.03, 0.90),
}


@dataclass(frozen=True)
class ModeResult:
    mode: str
    scored: Scored | None  # None: skipped
    greedy: list[list[int]]
    weight_bytes: int
    note: str = ""


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    hardware = detect_hardware(torch.device(args.device))
    print(f"hardware: {hardware.describe()}", flush=True)
    sections: list[list[str]] = []
    for name in (model.strip() for model in args.models.split(",")):
        if name:
            sections.append(model_section(args, name))
        if args.report_dir is not None:  # after each model: a long run's finished models are kept
            save(args.report_dir, hardware, args, sections)
    return 0


def _load(args: argparse.Namespace, model: str, mode: str, scratch: Path) -> LoadedModel:
    """``model`` in ``mode``; a calibrated mode's checkpoint is written under ``scratch`` once per format."""
    if mode not in CALIBRATED_MODES:
        quantization = MODE_CONFIGS[mode] if mode != "none" else "none"
        return load_model(model, device=args.device, dtype=args.dtype, quantization=quantization)
    fmt, w8a8 = CALIBRATED_MODES[mode]
    folder = scratch / fmt
    if not folder.exists():
        options = QuantizeOptions(fmt=fmt, device=args.device)
        write_quantized_checkpoint(model, folder, options)
    as_published = QuantizationConfig(fmt, dynamic_activations=w8a8)
    return load_model(folder, device=args.device, dtype=args.dtype, quantization=as_published)


def model_section(args: argparse.Namespace, model: str) -> list[str]:
    """Score the unquantized model and every mode; the model's tables."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-quantize-") as scratch:
        return _model_section(args, model, Path(scratch))


def _model_section(args: argparse.Namespace, model: str, scratch: Path) -> list[str]:
    reference_model = _load(args, model, "none", scratch)
    tokenizer = reference_model.tokenizer
    assert tokenizer is not None, f"{model} carries no tokenizer"
    tokens = tokenizer.encode(evaluation_text())[: args.max_tokens]
    prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
    reference = measure(args, "none", reference_model, tokens, prompts)
    del reference_model
    results = [reference]
    for mode in args.modes.split(","):
        try:
            loaded = _load(args, model, mode.strip(), scratch)
        except ModelLoadError as error:
            print(f"{model} {mode}: skipped ({error})", flush=True)
            results.append(ModeResult(mode, None, [], 0, f"skipped: {error}"))
            continue
        if mode.strip() in MODE_KERNELS:
            loaded.model = loaded.model.with_kernels(MODE_KERNELS[mode.strip()])
        results.append(measure(args, mode, loaded, tokens, prompts))
    describe = f"{model} ({len(tokens)} tokens scored, windows of {args.window})"
    return [f"## {describe}", "", *score_table(results), "", *greedy_table(results), ""]


def measure(
    args: argparse.Namespace, mode: str, loaded: LoadedModel, tokens: list[int], prompts: list[list[int]]
) -> ModeResult:
    chunk = DECODE_CHUNK_TOKENS if mode in MODE_KERNELS else CHUNK_TOKENS
    scored = score_text(loaded.model, tokens, args.window, chunk)
    greedy = greedy_continuations(loaded.model, prompts, args.greedy_tokens)
    print(f"{loaded.source} {mode}: perplexity {scored.perplexity:.3f} ({scored.seconds:.1f} s)", flush=True)
    return ModeResult(mode, scored, greedy, linear_weight_bytes(loaded.model))


def score_table(results: list[ModeResult]) -> list[str]:
    reference = results[0].scored
    assert reference is not None
    rows = []
    for result in results:
        if result.scored is None:
            rows.append([result.mode, "-", "-", "-", "-", "-", result.note])
            continue
        change = result.scored.perplexity / reference.perplexity - 1
        agreement = result.scored.agreement(reference)
        rows.append([
            result.mode,
            fmt_bytes(result.weight_bytes),
            f"{result.scored.perplexity:.3f}",
            "-" if result.mode == "none" else f"{change * 100:+.2f}%",
            "-" if result.mode == "none" else f"{agreement * 100:.1f}%",
            f"{result.scored.accuracy * 100:.1f}%",
            _verdict(result.mode, change, agreement),
        ])  # fmt: skip
    headers = ["mode", "projection + head weights", "perplexity", "change", "top-1 agreement",
               "top-1 = text", "target (issue 18)"]  # fmt: skip
    return [markdown_table(headers, rows)]


def _verdict(mode: str, change: float, agreement: float) -> str:
    if mode not in TARGETS:
        return "-" if mode == "none" else "no target"
    max_change, min_agreement = TARGETS[mode]
    met = abs(change) <= max_change and agreement >= min_agreement
    return f"{'met' if met else 'MISSED'} (<= {max_change:.0%}, >= {min_agreement:.0%})"


def greedy_table(results: list[ModeResult]) -> list[str]:
    reference = results[0].greedy
    rows = []
    for result in results[1:]:
        if result.scored is None:
            continue
        compared: GreedyComparison = compare_greedy(result.greedy, reference)
        divergence = ", ".join("=" if d is None else str(d) for d in compared.first_divergence)
        rows.append([
            result.mode,
            f"{compared.identical}/{len(reference)}",
            f"{compared.matching_tokens}/{compared.total_tokens}",
            divergence,
        ])  # fmt: skip
    headers = ["mode", "greedy continuations identical", "tokens equal", "first differing token per prompt"]
    return [markdown_table(headers, rows)]


def save(folder: Path, hardware: Hardware, args: argparse.Namespace, sections: list[list[str]]) -> None:
    workload = (
        f"teacher forcing over {TEXT_SOURCE}, up to {args.max_tokens} tokens in windows of {args.window}; "
        f"then {args.greedy_tokens} greedy tokens of each of {len(PROMPTS)} prompts: "
        + "; ".join(repr(p) for p in PROMPTS)
    )
    header = header_lines(
        "tokenmill quantization accuracy", workload, args.models, "the unquantized model (float weights)"
    )
    lines = [provenance(hardware).markdown() + "\n".join(header), ""]
    lines += [line for section in sections for line in section]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "accuracy.md").write_text("\n".join(lines))
    print(f"wrote {folder / 'accuracy.md'}")


def main(argv: list[str] | None = None) -> int:
    return run_as_script("accuracy", __doc__, add_arguments, run, argv)
