"""Block-scaled fp8 weights as published pre-quantized (DeepSeek-V3, Qwen3-*-FP8).

Layout followed (``config.json``: ``quantization_config = {"quant_method": "fp8", "weight_block_size":
[128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}``): each quantized linear has ``<name>.weight``
float8_e4m3fn ``[out, in]`` and ``<name>.weight_scale_inv`` float32 ``[ceil(out / 128), ceil(in / 128)]``,
and element ``(i, j)`` of the weight is ``weight[i, j] * weight_scale_inv[i // 128, j // 128]`` (the
"inverse" scale multiplies). Sources: DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``; Hugging Face
transformers' FineGrainedFP8 integration (``FP8Linear``: ``weight`` and ``weight_scale_inv`` of that
shape); vLLM's ``Fp8LinearMethod`` with ``weight_block_size`` (``create_weights`` makes the same two
parameters).

Shards of fused (q/k/v, gate/up) and tensor-parallel weights fall on 128-row blocks, and row-parallel
slices on 128-column blocks, so each shard carries whole blocks of scales (:mod:`.shards` refuses
others). The PyTorch path dequantizes the weight to the activation dtype and calls ``F.linear``.
"""

from functools import partial

import torch
from torch import nn

from tokenmill.kernels.options import KernelOptions
from tokenmill.quantization.method import (
    LinearMethod,
    MatmulPath,
    ProjectionLayer,
    WeightLoader,
    add_parameter,
    random_row_chunks,
)
from tokenmill.quantization.per_channel import dequantized_linear
from tokenmill.quantization.rounding import FP8_DTYPE, dequantize_fp8_blocks, quantize_fp8_blocks
from tokenmill.quantization.shards import DENSE, ParamLayout, RowShard

Block = tuple[int, int]


class Fp8BlockLinearMethod(LinearMethod):
    """e4m3 weights with one float32 scale per ``block`` (rows x columns), loaded as published."""

    name = "fp8_block"

    def __init__(self, block: Block = (128, 128)) -> None:
        self.block = block

    def create_weights(self, layer: nn.Module, out_local: int, in_local: int, loader: WeightLoader) -> None:
        weight = torch.empty(out_local, in_local, dtype=FP8_DTYPE)
        add_parameter(layer, "weight", weight, loader, DENSE)
        rows, cols = -(-out_local // self.block[0]), -(-in_local // self.block[1])
        scale = torch.ones(rows, cols, dtype=torch.float32)
        add_parameter(layer, "weight_scale_inv", scale, loader, ParamLayout(*self.block))

    def load(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard: RowShard) -> None:
        if param is layer.weight and loaded.dtype != FP8_DTYPE:
            raise ValueError(f"is {loaded.dtype}, but the block-scaled fp8 format stores {FP8_DTYPE}")
        super().load(layer, param, loaded, shard)

    def matmul_path(self, layer: ProjectionLayer, options: KernelOptions) -> MatmulPath:
        return partial(dequantized_linear, self, layer)

    def dequantized_weight(self, layer: ProjectionLayer, dtype: torch.dtype) -> torch.Tensor:
        scale: torch.Tensor = layer.weight_scale_inv  # type: ignore[attr-defined]
        return dequantize_fp8_blocks(layer.weight, scale, self.block, dtype)

    def init_dummy(self, layer: ProjectionLayer, generator: torch.Generator, std: float) -> None:
        scale: torch.Tensor = layer.weight_scale_inv  # type: ignore[attr-defined]
        for first, rows in random_row_chunks(layer.weight, generator, std):
            quantized, block_scale = quantize_fp8_blocks(rows, self.block)
            layer.weight.data.narrow(0, first, rows.shape[0]).copy_(quantized)
            start = first // self.block[0]
            scale.data.narrow(0, start, block_scale.shape[0]).copy_(block_scale)
