"""A step's integer inputs in one host buffer, so they reach the GPU in a single non-blocking copy.

Each named array (token ids, positions, slots, sequence lengths, block tables, ...) sits at a 16-byte
aligned offset of one byte buffer. On CUDA the host buffer is pinned, from PyTorch's caching host
allocator: it is not handed out again before the copy that reads it has run, so a fresh one per step
is safe and cheap. On CPU the host buffer is used in place.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 16
_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
}
_NUMPY_DTYPES = {torch_dtype: numpy_dtype for numpy_dtype, torch_dtype in _TORCH_DTYPES.items()}


@dataclass(frozen=True)
class _Field:
    offset: int  # bytes
    numel: int
    dtype: torch.dtype

    @property
    def end(self) -> int:
        return self.offset + self.numel * self.dtype.itemsize


class PackedLayout:
    """Where each named array lives in the byte buffer."""

    def __init__(self, fields: Sequence[tuple[str, torch.dtype, int]]) -> None:
        self.fields: dict[str, _Field] = {}
        offset = 0
        for name, dtype, numel in fields:
            self.fields[name] = _Field(offset, numel, dtype)
            offset = _round_up(offset + numel * dtype.itemsize, _ALIGN)
        self.nbytes = offset

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flat typed views of ``buffer`` (uint8, at least as long as the fields it covers)."""
        out = {}
        for name, field in self.fields.items():
            if field.end <= buffer.numel():
                out[name] = buffer[field.offset : field.end].view(field.dtype)
        return out

    def numpy_views(self, buffer: np.ndarray, numel: dict[str, int] | None = None) -> dict[str, np.ndarray]:
        """Typed numpy views of a uint8 host ``buffer`` (cheaper to make than tensor views); ``numel``
        shortens fields, e.g. to the rows a step fills."""
        numel = numel or {}
        out = {}
        for name, field in self.fields.items():
            end = field.offset + numel.get(name, field.numel) * field.dtype.itemsize
            out[name] = buffer[field.offset : end].view(_NUMPY_DTYPES[field.dtype])
        return out

    def prefix_bytes(self, name: str, numel: int) -> int:
        """Bytes from the buffer's start to the end of the first ``numel`` elements of field ``name``."""
        field = self.fields[name]
        return field.offset + numel * field.dtype.itemsize


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised uint8 host buffer, pinned when it will be copied to a GPU."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def pack_to_device(arrays: Mapping[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy int32 / int64 numpy arrays to ``device`` in one transfer; the results keep their shapes."""
    layout = PackedLayout([(name, _TORCH_DTYPES[a.dtype], a.size) for name, a in arrays.items()])
    host = host_buffer(layout.nbytes, device)
    for name, view in layout.numpy_views(host.numpy()).items():
        view[:] = arrays[name].reshape(-1)
    device_views = layout.views(to_device_async(host, device))
    return {name: view.view(arrays[name].shape) for name, view in device_views.items()}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
