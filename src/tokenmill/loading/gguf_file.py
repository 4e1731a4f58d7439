"""The GGUF container, read directly: a header of typed metadata key/values and a tensor directory,
followed by aligned tensor data that stays memory-mapped until a tensor is asked for.

gguf-py's ``GGUFReader`` builds a numpy view for every element of every metadata array, which takes
seconds on a 262k-token vocabulary; walking the header once with ``struct`` takes a fraction of that.
Dequantization is left to gguf-py (``gguf.quants.dequantize``); :meth:`GGUFFile.read_blocks` hands out a
tensor's quantized blocks as they are stored, for layers that compute on them without dequantizing
(``tokenmill.quantization.gguf_packed``).
"""

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from tokenmill.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALAR_FORMATS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32,
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: _U64,
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the contiguous (innermost) dimension first
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major shape, as PyTorch and Hugging Face checkpoints lay the tensor out."""
        return tuple(reversed(self.dims))


class _HeaderReader:
    """A cursor over the mapped file that reads GGUF's little-endian header encoding."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {message}")

    def _advance(self, size: int) -> int:
        start, end = self.pos, self.pos + size
        if end > len(self.buffer):
            raise self.error(
                f"the file is truncated: its header runs past the end of the file ({len(self.buffer)} bytes)"
            )
        self.pos = end
        return start

    def unpack(self, fmt: struct.Struct) -> Any:
        return fmt.unpack_from(self.buffer, self._advance(fmt.size))[0]

    def string(self) -> str:
        size = self.unpack(_U64)
        start = self._advance(size)
        try:
            return self.buffer[start : start + size].decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"the header holds a string that is not UTF-8 (at byte {start})") from None

    def value_type(self) -> GGUFValueType:
        raw = self.unpack(_U32)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.error(
                f"the header holds an unknown value type {raw} (at byte {self.pos - 4})"
            ) from None

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        return self.unpack(_SCALAR_FORMATS[kind])

    def array(self) -> list[Any]:
        kind, count = self.value_type(), self.unpack(_U64)
        if kind in _SCALAR_FORMATS:  # fixed-size items: one vectorized read
            fmt = _SCALAR_FORMATS[kind]
            start = self._advance(fmt.size * count)
            return np.frombuffer(self.buffer, np.dtype(fmt.format), count, start).tolist()
        return [self.value(kind) for _ in range(count)]


def _read_header(reader: _HeaderReader) -> tuple[int, int, int]:
    """Magic and version; returns (version, tensor count, metadata count)."""
    magic = reader.buffer[:4]
    if magic != GGUF_MAGIC:
        raise reader.error(f"not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
    reader.pos = 4
    version = reader.unpack(_U32)
    if version not in SUPPORTED_VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            raise reader.error("big-endian GGUF files are not supported")
        raise reader.error(f"GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})")
    return version, reader.unpack(_U64), reader.unpack(_U64)


def _read_metadata(reader: _HeaderReader, count: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(count):
        key = reader.string()
        metadata[key] = reader.value(reader.value_type())
    return metadata


def _read_tensor_directory(reader: _HeaderReader, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, GGUF dims, type id, offset relative to the data section) for every tensor."""
    entries = []
    for _ in range(count):
        name = reader.string()
        num_dims = reader.unpack(_U32)
        dims = tuple(reader.unpack(_U64) for _ in range(num_dims))
        entries.append((name, dims, reader.unpack(_U32), reader.unpack(_U64)))
    return entries


def _tensor_info(
    reader: _HeaderReader, entry: tuple[str, tuple[int, ...], int, int], data_start: int
) -> GGUFTensorInfo:
    name, dims, type_id, relative_offset = entry
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise reader.error(f"tensor '{name}' has an unknown data type id {type_id}") from None
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    if not dims or 0 in dims or dims[0] % block_size:
        raise reader.error(f"tensor '{name}' has dims {dims}, not whole {qtype.name} blocks of {block_size}")
    info = GGUFTensorInfo(
        name, dims, qtype, data_start + relative_offset, prod(dims) // block_size * block_bytes
    )
    if info.offset + info.nbytes > len(reader.buffer):
        raise reader.error(
            f"the file is truncated: tensor '{name}' needs bytes up to {info.offset + info.nbytes}, "
            f"but the file has {len(reader.buffer)}"
        )
    return info


def _map_file(path: Path) -> mmap.mmap:
    try:
        with path.open("rb") as file:
            if path.stat().st_size == 0:
                raise ModelLoadError(f"{path}: not a GGUF file: the file is empty")
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ModelLoadError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise ModelLoadError(f"{path} is a directory, not a GGUF file") from None
    except OSError as exc:
        raise ModelLoadError(f"{path} cannot be read: {exc.strerror or exc}") from None


class GGUFFile:
    """A parsed GGUF header over the memory-mapped file; tensors are read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._buffer = _map_file(path)
        reader = _HeaderReader(self._buffer, path)
        self.version, tensor_count, metadata_count = _read_header(reader)
        self.metadata = _read_metadata(reader, metadata_count)
        directory = _read_tensor_directory(reader, tensor_count)
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise reader.error(f"metadata 'general.alignment' must be a positive integer, got {alignment!r}")
        data_start = -(-reader.pos // alignment) * alignment
        infos = [_tensor_info(reader, entry, data_start) for entry in directory]
        self.tensors = {info.name: info for info in infos}

    def read_float32(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor dequantized to a writable float32 array of shape ``info.shape``."""
        raw = np.frombuffer(self._buffer, np.uint8, info.nbytes, info.offset)
        rows = raw.reshape(-1, info.nbytes // prod(info.dims[1:]))  # gguf-py dequantizes whole rows
        try:
            values = dequantize(rows, info.qtype)
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.path}: tensor '{info.name}' has type {info.qtype.name}, which gguf cannot dequantize"
            ) from None
        values = values.astype(np.float32, copy=False).reshape(info.shape)
        return values if values.flags.writeable else values.copy()

    def read_blocks(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's stored bytes, one row per output row: a read-only uint8 view of the mapped file of
        shape ``(rows, row_bytes)``, where a row of ``info.shape[-1]`` values is a whole number of
        ``info.qtype`` blocks (the reader checked that). Nothing is dequantized or copied."""
        rows = prod(info.dims[1:])
        raw = np.frombuffer(self._buffer, np.uint8, info.nbytes, info.offset)
        return raw.reshape(rows, info.nbytes // rows)
