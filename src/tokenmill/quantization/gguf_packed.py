"""GGUF weights kept in their 4- and 8-bit codes on the CPU, and the linear layer that computes on them.

A float32 projection reads 4 bytes per weight at every decode step; SmolLM2's Q4_1 codes with fp16 group
factors take 0.625. PyTorch's CPU weight-only kernels do not fit these formats:
``_weight_int4pack_mm_for_cpu`` is vectorized for bfloat16 only (activations, output and group factors in
bfloat16, which cannot hold GGUF's fp16 scales, let alone Q4_K's products of them), and its float32 path is
a scalar loop, ~50x slower than float32 oneDNN; ``_weight_int8pack_mm`` has one scale per output channel,
not per group of 32. So the kernel here is written in PyTorch and compiled by Inductor into one C++ loop
per call that reads the codes, forms each weight as ``code * scale + offset`` in registers (the exact
float32 weight of :mod:`gguf_blocks`) and accumulates its product with the activations: no float32 copy of
the weight is ever written.

Exactness: the weights are bit-identical to gguf-py's dequantized float32 (a one-hot input row returns a
weight column exactly); results differ from ``F.linear`` on those weights by float32 summation order only.
Each output element is one reduction over the input, in an order fixed by the compiled loop, so a row's
result does not depend on how many rows share the call (the same discipline as ``prepacked_cpu_linear``).
"""

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tokenmill.quantization.gguf_blocks import DecodedBlocks, GGUFBlocks, decode_blocks

KernelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _four_bit_products(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
) -> torch.Tensor:
    """``[N, M]`` products of ``x`` (``[M, K]`` float32) with 4-bit weights: ``codes`` is uint8
    ``[N, groups, half]`` holding value ``i`` of a group in the low nibble of byte ``i`` and value
    ``half + i`` in its high nibble. Output-major so that a weight row stays in cache across the M rows."""
    half = codes.shape[-1]
    pairs = x.view(x.shape[0], codes.shape[1], 2, half)
    factor = scale.float()[..., None]
    low = (codes & 15).float() * factor
    high = (codes >> 4).float() * factor
    if offset is not None:
        low = low + offset.float()[..., None]
        high = high + offset.float()[..., None]
    return (low[:, None] * pairs[:, :, 0]).sum((-1, -2)) + (high[:, None] * pairs[:, :, 1]).sum((-1, -2))


def _eight_bit_products(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
) -> torch.Tensor:
    """``[N, M]`` products of ``x`` with int8 weights ``codes`` (``[N, groups, group]``)."""
    weight = codes.float() * scale.float()[..., None]
    if offset is not None:
        weight = weight + offset.float()[..., None]
    return (weight[:, None] * x.view(x.shape[0], codes.shape[1], codes.shape[2])).sum((-1, -2))


class _Kernels:
    """The two kernels, compiled on first use (seconds each, then cached by Inductor on disk); eager
    when ``compiled`` is off (the same arithmetic, but the dequantized weight is materialized)."""

    def __init__(self) -> None:
        self.compiled = True
        self._cache: dict[str, KernelFn] = {}

    def get(self, four_bit: bool) -> KernelFn:
        fn: KernelFn = _four_bit_products if four_bit else _eight_bit_products
        if not self.compiled:
            return fn
        key = fn.__name__
        if key not in self._cache:
            self._cache[key] = torch.compile(fn, dynamic=True)
        return self._cache[key]


KERNELS = _Kernels()


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

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, self.dequantize(), bias)`` for float32 ``x`` of shape ``[..., in_features]``,
        without forming the float32 weight."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features; the weight takes {self.in_features}")
        rows = x.reshape(-1, self.in_features).float().contiguous()
        kernel = KERNELS.get(self.four_bit)
        out = kernel(rows, self.codes, self.scale, self.offset).t().contiguous()
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.out_features)

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


def _compact(factor: torch.Tensor) -> torch.Tensor:
    """float16 when every value survives the round trip (GGUF's own fp16 scales do), else float32."""
    half = factor.half()
    return half if torch.equal(half.float(), factor) else factor


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
    return PackedWeight(
        codes=_pack_codes(decoded),
        scale=_compact(decoded.scale),
        offset=None if decoded.offset is None else _compact(decoded.offset),
        group=decoded.group,
        qtype=blocks.qtype,
    )


def pack_gguf_tensor(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> PackedWeight:
    """A packed weight from a GGUF tensor's stored bytes (``GGUFFile.read_blocks``) and its row-major
    ``shape`` (``GGUFTensorInfo.shape``; leading dimensions are flattened into output rows)."""
    rows, cols = prod(shape[:-1]), shape[-1]
    return pack_blocks(GGUFBlocks(np.asarray(raw).reshape(rows, -1), qtype, rows, cols))
