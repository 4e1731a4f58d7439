"""A step's integer inputs, built in one place and sent in one host buffer, so they reach the GPU in a
single non-blocking copy (:func:`build_step_arrays`, :func:`pack_to_device`).

Each named array (token ids, positions, slots, sequence lengths, block tables, ...) sits at a 16-byte
aligned offset of one byte buffer. On CUDA the host buffer is pinned, from PyTorch's caching host
allocator: it is not handed out again before the copy that reads it has run, so a fresh one per step
is safe and cheap. On CPU the host buffer is used in place.
"""

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.output import ScheduledChunk

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
    """Copy int32 / int64 numpy arrays to ``device`` in one transfer; the results keep their shapes. On the
    CPU the tensors share the arrays' memory (each step's arrays are made for it and not kept)."""
    if device.type == "cpu":
        return {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in arrays.items()}
    layout = PackedLayout([(name, _TORCH_DTYPES[a.dtype], a.size) for name, a in arrays.items()])
    host = host_buffer(layout.nbytes, device)
    for name, view in layout.numpy_views(host.numpy()).items():
        view[:] = arrays[name].reshape(-1)
    device_views = layout.views(to_device_async(host, device))
    return {name: view.view(arrays[name].shape) for name, view in device_views.items()}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


PADDING_SLOT = -1  # a padding row's K/V is written nowhere
PADDING_SEQ_LEN = 1  # and it attends to one key of block 0 (finite: the pool starts zeroed)


def build_step_arrays(
    chunks: Sequence[ScheduledChunk],
    kv: KVCacheManager,
    num_rows: int | None = None,
    table_width: int | None = None,
    with_token_ids: bool = True,
) -> dict[str, np.ndarray]:
    """The host arrays of one step over ``chunks``: token ids and positions per token, sequence starts
    and lengths, the rows whose logits are sampled, and the KV slots and block tables (from ``kv``; none
    without a pool). The one builder of step inputs: eager steps copy these to the device as they are;
    graphs ask for ``num_rows`` rows (padding rows of one harmless token each) and block tables of a
    fixed ``table_width``, and decode graphs may leave the token ids out (they come from the device).

    A step of one chunk and no padding (batch 1, whose host work the device waits for: a verification
    step, a decode step, a prefill chunk) takes :func:`one_chunk_arrays`, the same arrays from a handful
    of numpy calls instead of some forty; others :func:`batch_step_arrays`."""
    if len(chunks) == 1 and (num_rows or 1) == 1:
        return one_chunk_arrays(chunks[0], kv, table_width, with_token_ids)
    return batch_step_arrays(chunks, kv, num_rows, table_width, with_token_ids)


def batch_step_arrays(
    chunks: Sequence[ScheduledChunk],
    kv: KVCacheManager,
    num_rows: int | None = None,
    table_width: int | None = None,
    with_token_ids: bool = True,
) -> dict[str, np.ndarray]:
    """:func:`build_step_arrays` for any chunks and padding rows, vectorised over the chunks."""
    num_seqs = len(chunks)
    starts = np.fromiter((chunk.start for chunk in chunks), np.int64, num_seqs)
    ends = np.fromiter((chunk.end for chunk in chunks), np.int64, num_seqs)
    lengths = ends - starts
    pad = (num_rows or num_seqs) - num_seqs
    query_start_loc = np.zeros(num_seqs + pad + 1, np.int32)
    query_start_loc[1:] = np.cumsum(np.concatenate([lengths, np.ones(pad, np.int64)]))
    num_tokens = int(lengths.sum())
    seq_of_token = np.repeat(np.arange(num_seqs), lengths)
    offsets = np.arange(num_tokens) - query_start_loc[:-1][:num_seqs][seq_of_token]
    seq_lens = _padded(ends.astype(np.int32), pad, PADDING_SEQ_LEN)
    arrays = {
        "positions": _padded(starts[seq_of_token] + offsets, pad, 0),
        "seq_lens": seq_lens,
        "seq_order": np.argsort(-seq_lens, kind="stable").astype(np.int32),
        "query_start_loc": query_start_loc,
        "sample_rows": _sample_rows(chunks, query_start_loc[1:][:num_seqs].astype(np.int64)),
    }
    if with_token_ids:
        ids = itertools.chain.from_iterable(c.seq.token_ids[c.start : c.end] for c in chunks)
        arrays["input_ids"] = _padded(np.fromiter(ids, np.int64, num_tokens), pad, 0)
    paging = kv.paging_arrays([chunk.seq for chunk in chunks], starts, ends, table_width)
    if paging:
        arrays["slot_mapping"] = _padded(paging["slot_mapping"], pad, PADDING_SLOT)
        tables = paging["block_tables"]
        arrays["block_tables"] = np.concatenate([tables, np.zeros((pad, tables.shape[1]), tables.dtype)])
    return arrays


def one_chunk_arrays(
    chunk: ScheduledChunk, kv: KVCacheManager, table_width: int | None = None, with_token_ids: bool = True
) -> dict[str, np.ndarray]:
    """:func:`batch_step_arrays` of a step that is one chunk with no padding rows."""
    start, end = chunk.start, chunk.end
    arrays: dict[str, np.ndarray] = {
        "positions": np.arange(start, end, dtype=np.int64),
        "seq_lens": np.array([end], np.int32),
        "seq_order": np.zeros(1, np.int32),
        "query_start_loc": np.array([0, end - start], np.int32),
        "sample_rows": np.arange(end - start - chunk.num_sampled_rows, end - start, dtype=np.int64),
    }
    if with_token_ids:
        arrays["input_ids"] = np.array(chunk.seq.token_ids[start:end], np.int64)
    arrays.update(kv.paging_arrays([chunk.seq], np.array([start]), np.array([end]), table_width))
    return arrays


def _sample_rows(chunks: Sequence[ScheduledChunk], chunk_ends: np.ndarray) -> np.ndarray:
    """The rows whose logits the step needs: the last row of each chunk that samples, and with draft
    tokens the rows before it that verify them (``num_sampled_rows`` each, in order)."""
    counts = np.fromiter((chunk.num_sampled_rows for chunk in chunks), np.int64, len(chunks))
    firsts = np.repeat(chunk_ends - counts, counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return firsts + within


def _padded(values: np.ndarray, pad: int, fill: int) -> np.ndarray:
    return np.concatenate([values, np.full(pad, fill, values.dtype)]) if pad else values


def attention_metadata(
    arrays: Mapping[str, torch.Tensor], max_query_len: int, max_seq_len: int
) -> AttentionMetadata:
    """Attention metadata over a step's device arrays (eager steps' or a decode graph's static buffers,
    whose ``max_seq_len`` is a bound rather than the step's value)."""
    return AttentionMetadata(
        query_start_loc=arrays["query_start_loc"],
        seq_lens=arrays["seq_lens"],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        slot_mapping=arrays.get("slot_mapping"),
        block_tables=arrays.get("block_tables"),
        seq_order=arrays.get("seq_order"),
    )
