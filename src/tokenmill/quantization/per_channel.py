"""Per-channel 8-bit weights: int8 (symmetric) and fp8 e4m3, one float32 scale per output row.

The layout is the GPU kernels' contract: ``layer.weight`` ``[out_local, in_local]`` (int8 or
float8_e4m3fn, row-major), ``layer.weight_scale`` float32 ``[out_local]``, and ``weight.float() *
weight_scale[:, None]`` is the weight. Float checkpoints (and dummy weights) are quantized as each tensor
is stored, shard by shard and 4096 rows at a time, so the float model never exists whole; the scale is
then derived state (a buffer). A row-parallel rank keeps a column slice but scales it by its whole row
(read from the tensor it is handed), so every rank count stores the same weights. A pre-quantized
checkpoint (compressed-tensors int8, ``weight_scale`` ``[out, 1]``) publishes the scale, which is then a
parameter loaded like the weight.

PyTorch paths: int8 on CPU, one row through ``aten._weight_int8pack_mm`` (weight-only, the int8 weight
read by the kernel; slower than dequantizing beyond one row, see :func:`int8_cpu_linear`); elsewhere, and
for fp8, the weight dequantized to the activation dtype and ``F.linear`` (a correct reference, not a fast
path). With ``dynamic_activations`` the input is first rounded per token as a W8A8
GEMM would (emulation, for measuring accuracy).
"""

from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.options import KernelOptions
from tokenmill.quantization.method import (
    CHUNK_ROWS,
    LinearMethod,
    MatmulPath,
    ProjectionLayer,
    WeightLoader,
    add_parameter,
    random_row_chunks,
)
from tokenmill.quantization.rounding import (
    FP8_DTYPE,
    FP8_MAX,
    INT8_MAX,
    dequantize_per_channel,
    fake_quantize_per_token,
    quantize_fp8_per_channel,
    quantize_int8_per_channel,
    row_amax,
)
from tokenmill.quantization.shards import DENSE, PER_ROW, RowShard

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def has_int8pack_mm() -> bool:
    """Whether this torch has the CPU int8 weight-only GEMM (``aten._weight_int8pack_mm``)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int8_cpu_linear(method: LinearMethod, layer: ProjectionLayer, x: torch.Tensor) -> torch.Tensor:
    """One row through ATen's int8 weight-only kernel, more through the dequantized reference: measured on
    the 2-core CPU (torch 2.13, a [3072, 576] weight) the kernel takes ~0.55 ms per row, linear in the rows,
    against ~0.1 ms for a float32 row, and ~0.5-1 ms for dequantizing then ``F.linear`` at any row count."""
    if x.numel() == x.shape[-1]:
        return int8pack_linear(layer, x)
    return dequantized_linear(method, layer, x)


def int8pack_linear(layer: ProjectionLayer, x: torch.Tensor) -> torch.Tensor:
    """``x W^T + b`` with int8 ``W`` read by ATen's weight-only kernel (scales in the input's dtype)."""
    weight: torch.Tensor = layer.weight
    scale: torch.Tensor = layer.weight_scale  # type: ignore[attr-defined]
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.aten._weight_int8pack_mm(rows, weight, scale.to(x.dtype))
    bias = layer.local_bias()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def dequantized_linear(method: LinearMethod, layer: ProjectionLayer, x: torch.Tensor) -> torch.Tensor:
    """The reference: the weight dequantized to ``x``'s dtype, then ``F.linear``."""
    return F.linear(x, method.dequantized_weight(layer, x.dtype), layer.local_bias())


def tensor_cores_take(weight: torch.Tensor) -> bool:
    """Whether cuBLAS multiplies this 8-bit weight with 8-bit activations: a CUDA device (float8 from
    compute capability 8.9 on) and both dimensions multiples of 16."""
    if weight.device.type != "cuda" or weight.shape[0] % 16 or weight.shape[1] % 16:
        return False
    return weight.dtype == torch.int8 or torch.cuda.get_device_capability(weight.device) >= (8, 9)


def w8a8_linear(
    method: LinearMethod, layer: ProjectionLayer, kernel: Kernel, x: torch.Tensor
) -> torch.Tensor:
    """``kernel`` (``tokenmill.kernels.scaled_matmul``) for half-precision inputs; float32 ones (the
    benchmarks' correctness check) take the weight-only reference."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return dequantized_linear(method, layer, x)
    return kernel(x, layer.weight, layer.weight_scale, layer.local_bias())  # type: ignore[attr-defined]


class PerChannelLinearMethod(LinearMethod):
    """8-bit weights with one scale per output row; subclasses name the dtype and its rounding."""

    weight_dtype: ClassVar[torch.dtype]
    gemv_scale = "weight_scale"
    max_value: ClassVar[float]  # the format's largest value: scale = amax(|row|) / max_value

    def __init__(self, prequantized: bool = False, dynamic_activations: bool = False) -> None:
        self.prequantized = prequantized  # the checkpoint publishes weight and weight_scale
        self.dynamic_activations = dynamic_activations  # round inputs per token first (W8A8 emulation)

    def create_weights(self, layer: nn.Module, out_local: int, in_local: int, loader: WeightLoader) -> None:
        weight = torch.empty(out_local, in_local, dtype=self.weight_dtype)
        add_parameter(layer, "weight", weight, loader, DENSE)
        scale = torch.ones(out_local, dtype=torch.float32)
        if self.prequantized:
            add_parameter(layer, "weight_scale", scale, loader, PER_ROW)
        else:
            layer.register_buffer("weight_scale", scale)

    def load(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard: RowShard) -> None:
        if param is not layer.weight:
            return super().load(layer, param, loaded, shard)
        if self.prequantized:
            if loaded.dtype != self.weight_dtype:
                raise ValueError(f"is {loaded.dtype}, but the checkpoint's format stores {self.weight_dtype}")
            return super().load(layer, param, loaded, shard)
        if not loaded.is_floating_point() or loaded.element_size() == 1:
            raise ValueError(f"is {loaded.dtype}: quantizing at load takes float weights")
        piece = DENSE.select(param, loaded, shard)
        # a column slice (row-parallel) takes its whole row's scale, so ranks store what one rank would
        whole_rows = loaded.narrow(0, shard.source, shard.size) if piece.shape[1] != loaded.shape[1] else None
        for start in range(0, piece.shape[0], CHUNK_ROWS):
            count = min(CHUNK_ROWS, piece.shape[0] - start)
            scale = None
            if whole_rows is not None:
                scale = row_amax(whole_rows.narrow(0, start, count).to(param.device)) / self.max_value
            rows = piece.narrow(0, start, count).to(param.device)
            self.store_rows(layer, shard.target + start, rows, scale)

    def store_rows(
        self, layer: nn.Module, first: int, rows: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        """Quantize float ``rows`` (with ``scale``, or their own) and store them and their scales from row
        ``first`` on."""
        quantized, scale = self.quantize(rows, scale)
        weight, weight_scale = cast(torch.Tensor, layer.weight), cast(torch.Tensor, layer.weight_scale)
        weight.data.narrow(0, first, rows.shape[0]).copy_(quantized)
        weight_scale.data.narrow(0, first, rows.shape[0]).copy_(scale)

    @abstractmethod
    def quantize(
        self, rows: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(8-bit rows, float32 scale per row) for float ``rows``, with ``scale`` or their own."""

    def matmul_path(self, layer: ProjectionLayer, options: KernelOptions) -> MatmulPath:
        if self.dynamic_activations:
            return partial(self.fake_w8a8_linear, layer)
        if options.w8a8 and tensor_cores_take(layer.weight):
            from tokenmill.kernels import scaled_matmul

            kernel = (
                scaled_matmul.int8_linear if self.weight_dtype == torch.int8 else scaled_matmul.fp8_linear
            )
            return partial(w8a8_linear, self, layer, kernel)
        return partial(dequantized_linear, self, layer)

    def fake_w8a8_linear(self, layer: ProjectionLayer, x: torch.Tensor) -> torch.Tensor:
        """W8A8 emulated: the input rounded per token to the weight's format, then the reference."""
        return dequantized_linear(self, layer, fake_quantize_per_token(x, self.weight_dtype))

    def dequantized_weight(self, layer: ProjectionLayer, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_per_channel(layer.weight, layer.weight_scale, dtype)  # type: ignore[attr-defined]

    def init_dummy(self, layer: ProjectionLayer, generator: torch.Generator, std: float) -> None:
        for first, rows in random_row_chunks(layer.weight, generator, std):
            self.store_rows(layer, first, rows)  # type: ignore[arg-type]


class Int8LinearMethod(PerChannelLinearMethod):
    """Symmetric per-channel int8 (``scale = amax / 127``)."""

    name = "int8"
    weight_dtype = torch.int8
    max_value = INT8_MAX

    def quantize(
        self, rows: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8_per_channel(rows, scale)

    def matmul_path(self, layer: ProjectionLayer, options: KernelOptions) -> MatmulPath:
        cpu = layer.weight.device.type == "cpu"
        if cpu and has_int8pack_mm() and not self.dynamic_activations:
            return partial(int8_cpu_linear, self, layer)
        return super().matmul_path(layer, options)


class Fp8LinearMethod(PerChannelLinearMethod):
    """e4m3 with per-channel scales (``scale = amax / 448``)."""

    name = "fp8"
    weight_dtype = FP8_DTYPE
    max_value = FP8_MAX

    def quantize(
        self, rows: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_per_channel(rows, scale)
