"""Exploration for issue 18: does rounding fp8 W8A8 inputs with a scale per group of input columns (as
block-scaled fp8 recipes do: 1 x 128 for activations) instead of one per token bring Gemma 3 270M's W8A8
agreement up? Loads the model with per-channel fp8 weights rounded at load and the W8A8 emulation on,
and scores the teacher-forced text of `tokenmill bench accuracy` with each input rounding.

    python scripts/experiments/quantization_activation_groups.py gemma3-270m 4096 [QUANTIZED_FOLDER]

QUANTIZED_FOLDER: a pre-quantized fp8 checkpoint of the same model (e.g. `tokenmill quantize --quantization
fp8`, GPTQ rounding) to take the weights from instead of rounding them at load.
"""

import sys
from collections.abc import Callable

import torch
from quantization_granularity import float_reference, print_scored

import tokenmill.quantization.per_channel as per_channel
from tokenmill.loading import load_model
from tokenmill.quantization.config import QuantizationConfig
from tokenmill.quantization.rounding import FP8_MAX

RoundFn = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def rounded_in_groups(group: int) -> RoundFn:
    """W8A8 input rounding with one e4m3 scale per ``group`` input columns of each token."""

    def rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
        scale = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        rounded = (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype).float()
        return (rounded * scale).reshape(x.shape).to(x.dtype)

    return rounding


def main(model_name: str, num_tokens: int, quantized_folder: str | None = None) -> None:
    reference_model, tokens, reference = float_reference(model_name, num_tokens)
    del reference_model
    w8a8 = QuantizationConfig("fp8", dynamic_activations=True)
    source = quantized_folder or model_name
    quantized = load_model(source, device="cpu", dtype="float32", quantization=w8a8)
    variants: list[tuple[str, RoundFn]] = [("per token", per_channel.fake_quantize_per_token)]
    variants += [(f"groups of {group}", rounded_in_groups(group)) for group in (128, 64, 32)]
    for label, rounding in variants:
        per_channel.fake_quantize_per_token = rounding  # what the W8A8 emulation calls
        print_scored(label, quantized.model, tokens, reference)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
