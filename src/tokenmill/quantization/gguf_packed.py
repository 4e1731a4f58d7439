"""GGUF weights kept in their 4- and 8-bit codes on the CPU, and the linear layer that computes on them.

A float32 projection reads 4 bytes per weight at every decode step; SmolLM2's Q4_1 codes with fp16 group
factors take 0.625. PyTorch's CPU weight-only kernels do not fit these formats:
``_weight_int4pack_mm_for_cpu`` is vectorized for bfloat16 only (activations, output and group factors in
bfloat16, which cannot hold GGUF's fp16 scales, let alone Q4_K's products of them), and its float32 path is
a scalar loop, ~50x slower than float32 oneDNN; ``_weight_int8pack_mm`` has one scale per output channel,
not per group of 32. The kernel is therefore tokenmill's own (``gguf_cpu_kernel.py``): it reads the codes,
forms each weight as ``code * scale + offset`` (the exact float32 weight of :mod:`gguf_blocks`) in vector
registers and multiplies it into up to four input rows at once; no float32 copy of the weight is stored.
A call of many rows (a prefill chunk) is compute-bound instead: there the kernel writes the float32 weight
out, a slice at a time, and BLAS multiplies it (``DEQUANTIZED_MIN_ROWS``).

Exactness: the weights are bit-identical to gguf-py's dequantized float32 (a one-hot input row returns a
weight column exactly); results differ from ``F.linear`` on those weights by float32 summation order only.
Below ``DEQUANTIZED_MIN_ROWS`` rows each output element is one reduction over the input, in an order fixed
by the kernel, so a row's result does not depend on how many rows share the call (the same discipline as
``prepacked_cpu_linear``). Integer ``activations`` (``gguf_integer_kernel.py``: ``int16``, or llama.cpp's
``int8``; AVX2 CPUs) round the inputs per block of 32 instead: same codes, integer products, the same
batch independence (calls of many rows take the float32 weights through BLAS in every mode).
"""

import ctypes
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from tokenmill.config import GGUFActivations
from tokenmill.quantization.gguf_blocks import DecodedBlocks, GGUFBlocks, concat_rows, decode_blocks
from tokenmill.quantization.gguf_cpu_kernel import load_kernel, run_dequantize, run_kernel
from tokenmill.quantization.gguf_integer_kernel import integer_function, load_integer_kernel
from tokenmill.quantization.gguf_prologue import NormPrologue, run_fused

# Steps of at least this many input rows (prefill chunks, large batches) multiply the float32 weight,
# formed by the kernel, with BLAS: per four rows the kernel forms every weight again. SmolLM2's layers on 2
# AVX2 cores (float kernel vs dequantize + F.linear, ms): 16 rows 0.25 / 0.34 (q/k/v), 1.02 / 1.09
# (gate/up); 32 rows 0.49 / 0.46, 1.84 / 1.50; 512 rows 11.9 / 4.1, 35.2 / 13.3.
DEQUANTIZED_MIN_ROWS = 32
_DEQUANTIZED_SLICE = 1 << 22  # float32 weights formed at a time (16 MiB)


_INTEGER_BITS = {"int16": 16, "int8": 8}


def fused_kernel(activations: GGUFActivations) -> Any | None:
    """The C function with ``gguf_prologue.py``'s calling convention for ``activations``: float32 inputs
    (``gguf_linear_prologue``) or integer ones (``gguf_linear_int16`` / ``gguf_linear_int8``); None where
    it is not built."""
    if activations == "float32":
        library = load_kernel()
        return None if library is None else library.gguf_linear_prologue
    return integer_function(_INTEGER_BITS[activations])


def activations_available(activations: GGUFActivations) -> bool:
    """Whether this CPU runs ``activations`` (float32 inputs: always, through PyTorch at worst)."""
    return activations == "float32" or load_integer_kernel(_INTEGER_BITS[activations]) is not None


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A ``[out_features, in_features]`` weight as GGUF codes with per-group factors: 4-bit codes two per
    byte (``codes`` uint8 ``[out, groups, group // 2]``) or int8 codes (``[out, groups, group]``); ``scale``
    and ``offset`` ``[out, groups]`` in float16 where that holds them exactly, else float32."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int
    qtype: GGMLQuantizationType

    def __deepcopy__(self, memo: dict[int, Any]) -> "PackedWeight":
        """Immutable: a configured copy of the model (``with_kernels``) shares the codes."""
        return self

    @property
    def four_bit(self) -> bool:
        return self.codes.dtype == torch.uint8

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the weight reads."""
        extra = 0 if self.offset is None else self.offset.nbytes
        return self.codes.nbytes + self.scale.nbytes + extra

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, activations: GGUFActivations = "float32"
    ) -> torch.Tensor:
        """``F.linear(x, self.dequantize(), bias)`` for float32 ``x`` of shape ``[..., in_features]``,
        without storing the float32 weight; with integer ``activations`` (where the CPU has AVX2), ``x``
        rounded per block of 32 (``gguf_integer_kernel.py``) in calls of fewer than
        ``DEQUANTIZED_MIN_ROWS`` rows."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features; the weight takes {self.in_features}")
        rows = x.reshape(-1, self.in_features).float().contiguous()
        integer = None if activations == "float32" else fused_kernel(activations)
        library = load_kernel()
        if library is None:  # no compiler: the same weights, through a float32 copy made per call
            out = F.linear(rows, self.dequantize())
        elif rows.shape[0] >= DEQUANTIZED_MIN_ROWS:
            out = self._dequantized_linear(library, rows)
        elif integer is not None:
            out, _ = run_fused(integer, rows, self.codes, self.scale, self.offset, self.group)
        else:
            out = run_kernel(library, rows, self.codes, self.scale, self.offset, self.group)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.out_features)

    def fused_linear(
        self,
        x: torch.Tensor,
        prologue: int | NormPrologue,
        bias: torch.Tensor | None = None,
        activations: GGUFActivations = "float32",
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The projection of the rows ``prologue`` forms from float32 ``x`` (``[..., K]``, ``[..., 2K]``
        for a gate) in one C call (``gguf_prologue.py``), the inputs as ``activations`` says, and for a
        norm ``x + residual``; None where that kernel is not built or the call has
        ``DEQUANTIZED_MIN_ROWS`` rows or more (the caller runs the prologue and :meth:`linear`)."""
        function = fused_kernel(activations)
        if function is None or x.numel() >= DEQUANTIZED_MIN_ROWS * x.shape[-1]:
            return None
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        out, total = run_fused(function, rows, self.codes, self.scale, self.offset, self.group, prologue)
        if bias is not None:
            out = out + bias
        lead = x.shape[:-1]
        return out.view(*lead, self.out_features), None if total is None else total.view(*lead, -1)

    def _dequantized_linear(self, library: ctypes.CDLL, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` times the float32 weight formed by the kernel, a slice of output rows at a time (each
        slice small enough for the allocator to reuse its memory), multiplied by BLAS."""
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        step = max(1, _DEQUANTIZED_SLICE // self.in_features)
        for first in range(0, self.out_features, step):
            part = slice(first, first + step)
            offset = None if self.offset is None else self.offset[part]
            weight = run_dequantize(library, self.codes[part], self.scale[part], offset, self.group)
            out[:, part] = F.linear(rows, weight)
        return out

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (or its ``rows``, e.g. embedding lookups of a tied LM head), bit for bit
        gguf-py's dequantization."""
        codes = self.codes if rows is None else self.codes[rows]
        scale = (self.scale if rows is None else self.scale[rows]).float()[..., None]
        if self.four_bit:
            codes = torch.cat([codes & 15, codes >> 4], dim=-1)
        weight = codes.float() * scale
        if self.offset is not None:
            weight = weight + (self.offset if rows is None else self.offset[rows]).float()[..., None]
        return weight.reshape(*weight.shape[:-2], self.in_features)


def _compact(factors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float16 when every value survives the round trip (GGUF's own fp16 scales do), else float32; one
    dtype for a weight's scale and offset."""
    halves = [factor.half() for factor in factors]
    exact = all(torch.equal(half.float(), factor) for half, factor in zip(halves, factors, strict=True))
    return halves if exact else factors


def _pack_codes(decoded: DecodedBlocks) -> torch.Tensor:
    rows, cols = decoded.codes.shape
    groups = decoded.codes.view(rows, cols // decoded.group, decoded.group)
    if not decoded.four_bit:
        return groups.contiguous()
    half = decoded.group // 2
    return groups[..., :half] | (groups[..., half:] << 4)


def pack_blocks(blocks: GGUFBlocks) -> PackedWeight:
    """A rank's (or the whole) weight from its GGUF blocks; see :class:`PackedWeight`."""
    decoded = decode_blocks(blocks)
    scale, *offset = _compact([decoded.scale] + ([] if decoded.offset is None else [decoded.offset]))
    codes = _pack_codes(decoded)
    return PackedWeight(codes, scale, offset[0] if offset else None, decoded.group, blocks.qtype)


def pack_gguf_tensor(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> PackedWeight:
    """A packed weight from a GGUF tensor's stored bytes (``GGUFFile.read_blocks``) and its row-major
    ``shape`` (``GGUFTensorInfo.shape``; leading dimensions are flattened into output rows)."""
    rows, cols = prod(shape[:-1]), shape[-1]
    return pack_blocks(GGUFBlocks(np.asarray(raw).reshape(rows, -1), qtype, rows, cols))


@dataclass(frozen=True, eq=False)
class PackedRows:
    """A fused weight (q/k/v, gate/up) whose parts are stored in different GGUF formats, as Gemma 3's
    Q5_0 q/k and Q8_0 v are: each part is packed alone and their outputs are concatenated. Parts of one
    format are better stacked before packing (``concat_rows``), which makes one kernel call."""

    parts: tuple[PackedWeight, ...]

    def __deepcopy__(self, memo: dict[int, Any]) -> "PackedRows":
        return self

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, activations: GGUFActivations = "float32"
    ) -> torch.Tensor:
        out = torch.cat([part.linear(x, None, activations) for part in self.parts], dim=-1)
        return out if bias is None else out + bias

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])


def pack_parts(parts: list[GGUFBlocks]) -> PackedWeight | PackedRows:
    """The fused weight of ``parts`` stacked by rows: one packed weight when they share a format, else
    one per run of parts that do."""
    runs: list[list[GGUFBlocks]] = []
    for part in parts:
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    packed = tuple(pack_blocks(concat_rows(run)) for run in runs)
    return packed[0] if len(packed) == 1 else PackedRows(packed)
