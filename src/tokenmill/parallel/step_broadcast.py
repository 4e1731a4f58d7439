"""What rank 0 sends its workers each step, as tensors (no pickled objects per step).

Every message starts with a header, ``HEADER_LEN`` int64 values on the gloo control group: the command,
then its arguments. ``FORWARD`` is followed by the step's integer inputs, the arrays of
:func:`~tokenmill.runner.step_inputs.build_step_arrays` packed into one uint8 buffer (their names are
fixed, so the header carries only each one's dtype and shape); ``LOGITS`` by the hidden rows whose
logits rank 0 computes, on the model's device group (the LM head's all-gather needs every rank).
"""

import enum
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist

from tokenmill.distributed import control_group
from tokenmill.runner.step_inputs import PackedLayout

STEP_FIELDS = (
    "input_ids",
    "positions",
    "seq_lens",
    "query_start_loc",
    "sample_rows",
    "slot_mapping",
    "block_tables",
)
_DTYPES = (torch.int64, torch.int32)
_FIELD_WORDS = 3  # per field: dtype code (-1: absent), rows, columns (-1: a flat array)
HEADER_LEN = 4 + _FIELD_WORDS * len(STEP_FIELDS)


class Command(enum.IntEnum):
    FORWARD = 1
    LOGITS = 2
    SHUTDOWN = 3
    SETUP = 4  # once, before the first step: the KV pool's blocks and the resolved max_model_len


class StepSender:
    """Rank 0's side: announces each forward pass and each logits computation to the workers."""

    def forward(self, arrays: Mapping[str, np.ndarray], max_query_len: int, max_seq_len: int) -> None:
        header = [0] * HEADER_LEN
        header[:3] = [Command.FORWARD, max_query_len, max_seq_len]
        fields = []
        for index, name in enumerate(STEP_FIELDS):
            slot = 4 + _FIELD_WORDS * index
            array = arrays.get(name)
            if array is None:
                header[slot] = -1
                continue
            dtype = torch.from_numpy(array[:0]).dtype
            rows, cols = (array.shape[0], array.shape[1]) if array.ndim == 2 else (array.size, -1)
            header[slot : slot + _FIELD_WORDS] = [_DTYPES.index(dtype), rows, cols]
            fields.append((name, dtype, array.size))
        layout = PackedLayout(fields)
        header[3] = layout.nbytes
        _broadcast_header(header)
        buffer = np.empty(layout.nbytes, np.uint8)
        for name, view in layout.numpy_views(buffer).items():
            view[:] = arrays[name].reshape(-1)
        dist.broadcast(torch.from_numpy(buffer), 0, group=control_group())

    def logits(self, hidden: torch.Tensor) -> None:
        header = [0] * HEADER_LEN
        header[:3] = [Command.LOGITS, hidden.shape[0], hidden.shape[1]]
        _broadcast_header(header)
        dist.broadcast(hidden.contiguous(), 0)

    def setup(self, num_blocks: int, max_model_len: int) -> None:
        header = [0] * HEADER_LEN
        header[:3] = [Command.SETUP, num_blocks, max_model_len]
        _broadcast_header(header)

    def shutdown(self) -> None:
        header = [0] * HEADER_LEN
        header[0] = Command.SHUTDOWN
        _broadcast_header(header)


def _broadcast_header(values: list[int]) -> None:
    dist.broadcast(torch.tensor(values, dtype=torch.int64), 0, group=control_group())


def receive_header() -> list[int]:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, 0, group=control_group())
    values: list[int] = header.tolist()
    return values


def receive_step_arrays(header: list[int]) -> dict[str, torch.Tensor]:
    """The step's integer inputs, on the host, in their shapes (after a ``FORWARD`` header)."""
    fields, shapes = [], {}
    for index, name in enumerate(STEP_FIELDS):
        code, rows, cols = header[4 + _FIELD_WORDS * index : 4 + _FIELD_WORDS * (index + 1)]
        if code < 0:
            continue
        fields.append((name, _DTYPES[code], rows * cols if cols >= 0 else rows))
        shapes[name] = (rows, cols) if cols >= 0 else (rows,)
    layout = PackedLayout(fields)
    buffer = torch.empty(header[3], dtype=torch.uint8)
    dist.broadcast(buffer, 0, group=control_group())
    return {name: view.view(shapes[name]) for name, view in layout.views(buffer).items()}


def receive_hidden(header: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The hidden rows whose logits rank 0 computes (after a ``LOGITS`` header)."""
    hidden = torch.empty(header[1], header[2], dtype=dtype, device=device)
    dist.broadcast(hidden, 0)
    return hidden
