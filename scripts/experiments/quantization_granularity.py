"""Exploration for issue 18: does a finer weight-scale granularity bring Gemma 3 270M's fp8 / int8 within
the accuracy targets? Loads the float32 model, rounds every projection weight (not the embedding / tied
head) through each variant in place (quantize, then dequantize: the values a weight-only kernel would
use), and scores the same teacher-forced text as `tokenmill bench accuracy` (score_text, windows of 1024).

    python scripts/experiments/quantization_granularity.py gemma3-270m 4096 [LABEL-SUBSTRING]
"""

import sys
import time
from collections.abc import Callable

import torch

from tokenmill.benchmarks.accuracy.measure import Scored, score_text
from tokenmill.benchmarks.accuracy.text import evaluation_text
from tokenmill.loading import LoadedModel, load_model
from tokenmill.quantization.rounding import FP8_DTYPE, dequantize_fp8_blocks, quantize_fp8_blocks


def rounded_in_groups(weight: torch.Tensor, group: int, kind: str) -> torch.Tensor:
    """``weight`` through symmetric int8 or e4m3 with one scale per ``group`` input columns of a row."""
    rows, columns = weight.shape
    grouped = weight.reshape(rows, columns // group, group)
    amax = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    if kind == "int8":
        scale = amax / 127
        return ((grouped / scale).round().clamp(-127, 127) * scale).reshape(rows, columns)
    scale = amax / 448
    return ((grouped / scale).to(FP8_DTYPE).float() * scale).reshape(rows, columns)


def int8_clipped(weight: torch.Tensor, ratios: int = 40, lowest: float = 0.6) -> torch.Tensor:
    """``weight`` through symmetric int8 with one scale per row, each row's scale the one of ``ratios``
    clipping levels (``lowest`` to 1 times the row's absolute max) with the least squared rounding error:
    the format the engine's kernels read, only the scale chosen differently."""
    amax = weight.abs().amax(1, keepdim=True).clamp(min=1e-12)
    best = torch.full_like(amax, float("inf"))
    out = weight.clone()
    for ratio in torch.linspace(lowest, 1.0, ratios).tolist():
        scale = amax * ratio / 127
        rounded = (weight / scale).round().clamp(-127, 127) * scale
        error = (rounded - weight).pow(2).sum(1, keepdim=True)
        better = error < best
        best = torch.where(better, error, best)
        out = torch.where(better, rounded, out)
    return out


def fp8_blocks(weight: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8_blocks(*quantize_fp8_blocks(weight, (128, 128)), (128, 128), torch.float32)


VARIANTS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("fp8 per-channel", lambda w: rounded_in_groups(w, w.shape[1], "fp8")),
    ("fp8 128x128 blocks", fp8_blocks),
    ("fp8 groups of 128", lambda w: rounded_in_groups(w, 128, "fp8")),
    ("fp8 groups of 64", lambda w: rounded_in_groups(w, 64, "fp8")),
    ("int8 per-channel", lambda w: rounded_in_groups(w, w.shape[1], "int8")),
    ("int8 groups of 128", lambda w: rounded_in_groups(w, 128, "int8")),
    ("int8 per-channel, scale clipped for least squared error", int8_clipped),
]


def print_scored(label: str, model: torch.nn.Module, tokens: list[int], base: Scored) -> None:
    """Score ``tokens`` teacher-forced (windows of 1,024) and print perplexity and top-1 agreement against
    ``base``, the float model's score."""
    started = time.time()
    scored = score_text(model, tokens, 1024)
    change = scored.perplexity / base.perplexity - 1
    print(
        f"{label}: perplexity {scored.perplexity:.3f} ({change:+.2%}), top-1 agreement "
        f"{scored.agreement(base):.1%} ({time.time() - started:.0f} s)",
        flush=True,
    )


def float_reference(model_name: str, num_tokens: int) -> tuple[LoadedModel, list[int], Scored]:
    """The float32 model, the first ``num_tokens`` of the evaluation text, and the model's score on them."""
    torch.set_num_threads(2)
    loaded = load_model(model_name, device="cpu", dtype="float32", quantization="none")
    assert loaded.tokenizer is not None
    tokens = loaded.tokenizer.encode(evaluation_text())[:num_tokens]
    base = score_text(loaded.model, tokens, 1024)
    print(f"float32: perplexity {base.perplexity:.3f}", flush=True)
    return loaded, tokens, base


def main(model_name: str, num_tokens: int, only: str = "") -> None:
    loaded, tokens, base = float_reference(model_name, num_tokens)
    originals = {
        name: p.detach().clone()
        for name, p in loaded.model.named_parameters()
        if p.dim() == 2 and "embed" not in name
    }
    for label, rounded in VARIANTS:
        if only and only not in label:
            continue
        for name, parameter in loaded.model.named_parameters():
            if name in originals:
                parameter.data.copy_(rounded(originals[name]))
        print_scored(label, loaded.model, tokens, base)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
