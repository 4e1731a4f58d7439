"""``quantization="gguf"``: a projection keeps the GGUF blocks it is loaded from, packed, and multiplies
with :class:`PackedWeight` (tokenmill's CPU kernel), so no float32 copy of the weight is ever formed.

The GGUF checkpoint, asked to keep blocks packed, yields a projection's tensor as :class:`GGUFBlocks` (its
stored bytes, q/k rows already un-permuted) instead of dequantized float32. The layer's sharding rule
hands the method a :class:`RowShard` per part as it does for every format; the method keeps that part's
rows (and, row-parallel, its block-aligned columns) as blocks, and once every row of the layer has arrived
packs them (:func:`pack_parts`: one weight per run of parts in one format). ``layer.weight`` is a
placeholder with no columns: the engine only asks it for its device and dtype.

CPU only (the kernels are C loops). The weights are bit-identical to the float32 dequantized ones;
``KernelOptions.gguf_activations`` says what the inputs become: ``float32`` (the default), which gives
the float32 engine's results up to summation order, or ``int16`` / ``int8`` (AVX2 CPUs), rounded per
block of 32 and multiplied as integers (``gguf_integer_kernel.py``). Either way
:func:`fused_packed_linear` lets the norm or activation before a projection run in the same C call.
"""

from functools import partial
from typing import Any

import torch
from torch import nn

from tokenmill.config import GGUFActivations
from tokenmill.kernels.options import KernelOptions
from tokenmill.quantization.gguf_blocks import SUPPORTED_QTYPES, GGUFBlocks
from tokenmill.quantization.gguf_packed import PackedRows, PackedWeight, pack_parts
from tokenmill.quantization.gguf_prologue import NormPrologue
from tokenmill.quantization.method import (
    LinearMethod,
    MatmulPath,
    ProjectionLayer,
    WeightLoader,
    add_parameter,
)
from tokenmill.quantization.shards import RowShard

Packed = PackedWeight | PackedRows
_PARTS = "gguf_parts"  # layer attribute: {target row: blocks} while the layer's parts arrive
_PACKED = "gguf_packed"  # layer attribute: the packed weight once every row has arrived
_ROWS = "gguf_rows"  # layer attribute: the rows the layer holds (its out_local)


def packed_weight(layer: Any) -> Packed:
    """The layer's packed weight; an error naming the cause if loading never completed it."""
    packed: Packed | None = getattr(layer, _PACKED, None)
    if packed is None:
        stored = sum(part.rows for part in getattr(layer, _PARTS, {}).values())
        raise RuntimeError(
            f"gguf layer has {stored} of its {getattr(layer, _ROWS, '?')} rows: it was not loaded from a "
            f"GGUF file (quantization 'gguf' needs one)"
        )
    return packed


def single_packed_weight(module: nn.Module) -> PackedWeight | None:
    """The module's packed weight where it is one (not parts in several formats), else None."""
    packed = getattr(module, _PACKED, None)
    return packed if isinstance(packed, PackedWeight) else None


def packed_nbytes(module: nn.Module) -> int:
    """Bytes of the packed weight ``module`` holds (0: none), which its placeholder ``weight`` omits."""
    packed: Packed | None = getattr(module, _PACKED, None)
    return 0 if packed is None else packed.nbytes


def packed_numel(module: nn.Module) -> int:
    """Weights of the packed weight ``module`` holds (0: none), which its placeholder ``weight`` omits."""
    packed: Packed | None = getattr(module, _PACKED, None)
    return 0 if packed is None else packed.out_features * packed.in_features


def _packed_linear(layer: ProjectionLayer, activations: GGUFActivations, x: torch.Tensor) -> torch.Tensor:
    out = packed_weight(layer).linear(x, layer.local_bias(), activations)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def fused_packed_linear(
    layer: nn.Module, x: torch.Tensor, prologue: int | NormPrologue, activations: GGUFActivations
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A GGUF-packed layer's projection of the rows ``prologue`` forms from ``x``, in one kernel call
    (:meth:`PackedWeight.fused_linear`); None where the layer is not one packed weight in float32 or the
    call is not one the kernel takes: the caller runs the prologue and the projection one after the other."""
    packed = getattr(layer, _PACKED, None)
    if not isinstance(packed, PackedWeight) or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if isinstance(prologue, NormPrologue) and prologue.weight.dtype != torch.float32:
        return None
    result = packed.fused_linear(x, prologue, layer.local_bias(), activations)  # type: ignore[operator]
    if result is None:
        return None
    return layer.reduce(result[0]), result[1]  # type: ignore[operator]


class GGUFLinearMethod(LinearMethod):
    """GGUF blocks kept packed (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), computed on by the CPU kernel."""

    name = "gguf"

    def create_weights(self, layer: nn.Module, out_local: int, in_local: int, loader: WeightLoader) -> None:
        # No columns: the placeholder costs nothing, and still tells the engine the device and dtype.
        add_parameter(layer, "weight", torch.empty(out_local, 0), loader)
        setattr(layer, _ROWS, out_local)
        setattr(layer, _PARTS, {})
        setattr(layer, _PACKED, None)
        layer.gguf_in_features = in_local  # type: ignore[assignment]

    def load(self, layer: nn.Module, param: torch.Tensor, loaded: Any, shard: RowShard) -> None:
        if param is not layer.weight:  # a bias: float, stored as every method stores it
            return super().load(layer, param, loaded, shard)
        if not isinstance(loaded, GGUFBlocks):
            dtype = getattr(loaded, "dtype", type(loaded).__name__)
            raise ValueError(
                f"is {dtype}, not GGUF blocks: quantization 'gguf' keeps only a GGUF file's packed "
                f"formats ({', '.join(q.name for q in SUPPORTED_QTYPES)}); load this model with 'none'"
            )
        blocks = self._select(layer, loaded, shard)
        parts: dict[int, GGUFBlocks] = getattr(layer, _PARTS)
        parts[shard.target] = blocks
        if sum(part.rows for part in parts.values()) == getattr(layer, _ROWS):
            # every row is here: pack once, and drop the blocks (views of the mapped file)
            setattr(layer, _PACKED, pack_parts([parts[target] for target in sorted(parts)]))
            parts.clear()

    @staticmethod
    def _select(layer: nn.Module, loaded: GGUFBlocks, shard: RowShard) -> GGUFBlocks:
        """The shard's rows (and row-parallel columns) of ``loaded``, its shape checked first."""
        cols = layer.gguf_in_features if shard.columns is None else shard.columns[0]
        if (loaded.rows, loaded.cols) != (shard.full_rows, cols):
            raise ValueError(
                f"has shape {(loaded.rows, loaded.cols)} but the model expects {(shard.full_rows, cols)}"
            )
        blocks = loaded.narrow_rows(shard.source, shard.size)
        if shard.columns is not None:
            _, first, count = shard.columns
            blocks = blocks.narrow_cols(first, count)
        return blocks

    def matmul_path(self, layer: ProjectionLayer, options: KernelOptions) -> MatmulPath:
        # Bound at construction too, before loading: the packed weight is looked up per call.
        return partial(_packed_linear, layer, options.gguf_activations)

    def dequantized_weight(self, layer: ProjectionLayer, dtype: torch.dtype) -> torch.Tensor:
        return packed_weight(layer).dequantize().to(dtype)

    def init_dummy(self, layer: ProjectionLayer, generator: torch.Generator, std: float) -> None:
        raise ValueError("quantization 'gguf' needs a GGUF file: dummy weights have no GGUF blocks")
