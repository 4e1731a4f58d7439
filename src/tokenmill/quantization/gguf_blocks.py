"""GGUF quantized blocks as they are stored, sliced for tensor parallelism and decoded into integer codes
with exact float32 group scales.

A GGUF weight of shape ``[rows, cols]`` is stored row by row, each row a run of fixed-size blocks of 32
(Q4_0, Q4_1, Q5_0, Q8_0) or 256 (K-quants) values. Every format supported here dequantizes as
``w = code * scale + offset`` per group of 16 or 32 values, with a small integer ``code`` and float32
``scale`` / ``offset`` that are exact products of the block's fp16 factors and its small integer
sub-scales. Computing ``code * scale`` (exact: at most 11 + 8 + 6 significant bits) and then adding
``offset`` (one rounding) gives the same float32 bits as gguf-py's ``dequantize``, which the weights are
compared against. A layer can therefore keep the 4-bit or 8-bit codes and still compute with the very
weights the float32 path uses.

Slicing happens on the blocks, before decoding: a rank's output rows (column-parallel shards, the q/k/v
and gate/up parts) are a row range; its input columns (row-parallel shards) are a range of whole blocks.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType


@dataclass(frozen=True)
class GGUFBlocks:
    """One 2-D GGUF tensor's stored bytes: ``data`` is uint8 ``[rows, cols // block_size * block_bytes]``
    (as :meth:`GGUFFile.read_blocks` returns it, possibly a read-only view of the mapped file)."""

    data: np.ndarray
    qtype: GGMLQuantizationType
    rows: int
    cols: int

    def __post_init__(self) -> None:
        block_size, block_bytes = GGML_QUANT_SIZES[self.qtype]
        if self.cols % block_size or self.data.shape != (self.rows, self.cols // block_size * block_bytes):
            raise ValueError(
                f"{self.qtype.name} blocks of shape {self.data.shape} do not hold a [{self.rows}, "
                f"{self.cols}] tensor (blocks of {block_size} values in {block_bytes} bytes)"
            )

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    def narrow_rows(self, start: int, length: int) -> "GGUFBlocks":
        """Output rows ``[start, start + length)``: a column-parallel shard or one part of a fused q/k/v
        or gate/up weight."""
        if start < 0 or length <= 0 or start + length > self.rows:
            raise ValueError(f"rows [{start}, {start + length}) are outside the tensor's {self.rows} rows")
        return GGUFBlocks(self.data[start : start + length], self.qtype, length, self.cols)

    def narrow_cols(self, start: int, length: int) -> "GGUFBlocks":
        """Input columns ``[start, start + length)``, a row-parallel shard: both ends must fall on block
        boundaries (32 values, 256 for K-quants), since a block's values share their scales."""
        block_size, block_bytes = GGML_QUANT_SIZES[self.qtype]
        if start % block_size or length % block_size:
            raise ValueError(
                f"columns [{start}, {start + length}) do not fall on {self.qtype.name} block boundaries "
                f"(multiples of {block_size})"
            )
        if start < 0 or length <= 0 or start + length > self.cols:
            raise ValueError(f"columns [{start}, {start + length}) are outside the tensor's {self.cols}")
        first, count = start // block_size * block_bytes, length // block_size * block_bytes
        return GGUFBlocks(self.data[:, first : first + count], self.qtype, self.rows, length)

    def take_rows(self, order: torch.Tensor) -> "GGUFBlocks":
        """Rows reordered (``order[i]`` is the source of row ``i``), e.g. llama.cpp's q/k rotary
        permutation undone: ``unpermute_rotary_rows(torch.arange(rows), heads)`` gives the order."""
        return GGUFBlocks(self.data[order.numpy()], self.qtype, len(order), self.cols)


def concat_rows(parts: "list[GGUFBlocks]") -> GGUFBlocks:
    """Parts stacked by rows, as a fused q/k/v or gate/up weight holds them; they must share a format
    (GGUF files may store q, k and v in different ones, e.g. Gemma 3's Q5_0 q/k and Q8_0 v: such a weight
    stays in separate parts)."""
    formats = {(part.qtype, part.cols) for part in parts}
    if len(formats) != 1:
        raise ValueError(f"parts of one weight must share format and width, got {sorted(formats)}")
    data = np.concatenate([part.data for part in parts])
    return GGUFBlocks(data, parts[0].qtype, data.shape[0], parts[0].cols)


@dataclass(frozen=True)
class DecodedBlocks:
    """``w[r, c] = codes[r, c] * scale[r, c // group] + offset[r, c // group]`` in float32, bit for bit as
    gguf-py dequantizes the blocks. ``codes`` is uint8 in [0, 15] (4-bit formats) or int8; ``offset`` is
    None where the format has none (the weight is then ``codes * scale``)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int

    @property
    def four_bit(self) -> bool:
        return self.codes.dtype == torch.uint8


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields (``[..., 2]`` bytes) as float32: exact."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """``[..., n]`` bytes to ``[..., 2n]`` codes: the low nibbles, then the high nibbles."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _decode_q4_0(b: np.ndarray) -> DecodedBlocks:
    d = _fp16(b[:, :, 0:2])
    # (q - 8) * d is exact, and so is q * d - 8 * d: one rounding of an exact value changes nothing.
    return _decoded(_nibbles(b[:, :, 2:18]), d, -8 * d, 32)


def _decode_q4_1(b: np.ndarray) -> DecodedBlocks:
    return _decoded(_nibbles(b[:, :, 4:20]), _fp16(b[:, :, 0:2]), _fp16(b[:, :, 2:4]), 32)


def _decode_q5_0(b: np.ndarray) -> DecodedBlocks:
    high = np.unpackbits(b[:, :, 2:6], axis=-1, bitorder="little")  # bit j of the 32-bit qh is value j's
    codes = (_nibbles(b[:, :, 6:22]) | (high << 4)).astype(np.int8) - 16
    return _decoded(codes, _fp16(b[:, :, 0:2]), None, 32)


def _decode_q8_0(b: np.ndarray) -> DecodedBlocks:
    return _decoded(np.ascontiguousarray(b[:, :, 2:34]).view(np.int8), _fp16(b[:, :, 0:2]), None, 32)


def _q4_k_sub_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of a Q4_K super-block, packed in 12 bytes: bytes 0-3 hold
    scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from bytes 8-11 (low
    and high nibble) and their top 2 bits from the spare top bits of bytes 0-3 and 4-7."""
    first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 0x3F, (rest & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 0x3F, (rest >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales, mins


def _decode_q4_k(b: np.ndarray) -> DecodedBlocks:
    d, dmin = _fp16(b[:, :, 0:2]), _fp16(b[:, :, 2:4])
    scales, mins = _q4_k_sub_scales(b[:, :, 4:16])
    # Four runs of 32 bytes: run i holds sub-block 2i in its low nibbles and 2i + 1 in its high ones.
    codes = _nibbles(b[:, :, 16:144].reshape(*b.shape[:2], 4, 32)).reshape(*b.shape[:2], 256)
    return _decoded(codes, d[..., None] * scales, -(dmin[..., None] * mins), 32)


def _decode_q6_k(b: np.ndarray) -> DecodedBlocks:
    """Two halves of 128 values; a half's 64 low-nibble bytes and 32 two-bit bytes give values 0-31 and
    64-95 (low nibbles of bytes 0-31 / high nibbles, two-bit fields 0 / 2) and 32-63 and 96-127 (bytes
    32-63; two-bit fields 1 / 3)."""
    low = b[:, :, 0:128].reshape(*b.shape[:2], 2, 2, 32)  # half, byte run, byte
    high = b[:, :, 128:192].reshape(*b.shape[:2], 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    two_bits = (high >> shifts) & 0x03  # [.., half, field, byte]: field f holds quarter f of the half
    first, second = low[..., 0, :], low[..., 1, :]
    nibbles = np.stack([first & 0x0F, second & 0x0F, first >> 4, second >> 4], axis=-2)
    codes = ((nibbles | (two_bits << 4)).astype(np.int8) - 32).reshape(*b.shape[:2], 256)
    sub_scales = np.ascontiguousarray(b[:, :, 192:208]).view(np.int8).astype(np.float32)
    return _decoded(codes, _fp16(b[:, :, 208:210])[..., None] * sub_scales, None, 16)


def _decoded(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, group: int) -> DecodedBlocks:
    """Per-row codes and factors from ``[rows, blocks, values]`` codes and ``[rows, blocks(, groups)]``
    factors (one group per block unless the block has sub-blocks)."""
    rows = codes.shape[0]

    def flat(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values.reshape(rows, -1)))

    return DecodedBlocks(
        flat(codes), flat(scale.astype(np.float32)), None if offset is None else flat(offset), group
    )


_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], DecodedBlocks]] = {
    Q.Q4_0: _decode_q4_0,
    Q.Q4_1: _decode_q4_1,
    Q.Q5_0: _decode_q5_0,
    Q.Q8_0: _decode_q8_0,
    Q.Q4_K: _decode_q4_k,
    Q.Q6_K: _decode_q6_k,
}
SUPPORTED_QTYPES = tuple(_DECODERS)


def decode_blocks(blocks: GGUFBlocks) -> DecodedBlocks:
    """The blocks' integer codes and exact float32 group factors (see :class:`DecodedBlocks`)."""
    decoder = _DECODERS.get(blocks.qtype)
    if decoder is None:
        raise NotImplementedError(
            f"GGUF {blocks.qtype.name} weights cannot be kept packed "
            f"(packed: {', '.join(q.name for q in SUPPORTED_QTYPES)})"
        )
    block_bytes = GGML_QUANT_SIZES[blocks.qtype][1]
    return decoder(np.asarray(blocks.data).reshape(blocks.rows, -1, block_bytes))
