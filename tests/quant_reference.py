"""Naive quantization written for the tests, independent of tokenmill.quantization: per-row int8 / fp8
and block fp8 by their definitions, and checkpoints written in the published layouts."""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn


def naive_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().max(dim=1).values / 127
    return torch.round(weight / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8), scale


def naive_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().max(dim=1).values / 448
    return (weight / scale.unsqueeze(1)).to(FP8), scale


def naive_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per block, by loops (tiny weights only)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    quantized, scale = torch.empty(rows, cols, dtype=FP8), torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale[i, j] = tile.abs().max() / 448
            quantized[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (
                tile / scale[i, j]
            ).to(FP8)
    return quantized, scale


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = weight.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale[i, j]
    return out


def is_quantized_linear(name: str) -> bool:
    """The checkpoint tensors a published format quantizes: every projection weight, not the LM head."""
    return name.endswith("_proj.weight")


def write_prequantized(folder: Path, out: Path, fmt: str, block: tuple[int, int] = (32, 32)) -> Path:
    """``out``: ``folder``'s float checkpoint in a published format (``fp8_block`` or ``int8_ct``); and
    ``out / "dequantized"``: a float checkpoint of the weights that format stands for."""
    tensors = load_file(folder / "model.safetensors")
    published: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not is_quantized_linear(name):
            published[name] = dequantized[name] = tensor
            continue
        base = name.removesuffix(".weight")
        if fmt == "fp8_block":
            weight, scale = naive_fp8_blocks(tensor, block)
            published[name], published[f"{base}.weight_scale_inv"] = weight, scale
            dequantized[name] = dequantize_blocks(weight, scale, block)
        else:
            weight, scale = naive_int8(tensor)
            scale = scale.to(torch.bfloat16)  # llm-compressor stores the scale in the model's dtype
            published[name], published[f"{base}.weight_scale"] = weight, scale.unsqueeze(1)
            dequantized[name] = weight.float() * scale.float().unsqueeze(1)
    config = json.loads((folder / "config.json").read_text())
    for target, weights, quantization in (
        (out, published, published_config(fmt, block)),
        (out / "dequantized", dequantized, None),
    ):
        target.mkdir(parents=True, exist_ok=True)
        save_file(weights, target / "model.safetensors")
        written = {**config, "quantization_config": quantization} if quantization else config
        (target / "config.json").write_text(json.dumps(written))
    return out


def published_config(fmt: str, block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    if fmt == "fp8_block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
        }
    token = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": "channel"}
    group = {"weights": weights, "input_activations": token, "targets": ["Linear"]}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }
