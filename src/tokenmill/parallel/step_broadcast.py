"""What rank 0 sends its workers each step, as tensors (no pickled objects per step).

Every message starts with a header, ``HEADER_LEN`` int64 values on the gloo control group: the command,
then its arguments. ``FORWARD`` is followed by the step's integer inputs, the arrays of
:func:`~tokenmill.runner.step_inputs.build_step_arrays` packed into one uint8 buffer (their names are
fixed, so the header carries only each one's dtype and shape); ``LOGITS`` by the hidden rows whose
logits rank 0 computes, on the model's device group (the LM head's all-gather needs every rank).

Steps through graph runners (CUDA graphs on a GPU, their static buffers run eagerly elsewhere) travel
the same way: ``GRAPHS`` once, with the plan's sizes (on the model's group: with NCCL this first
collective sets up the communicator before anything is captured), then per step ``DECODE_GRAPH`` or
``PREFILL_GRAPH`` with the step's arrays and its padded size, and ``START_NEXT`` (an overlapped decode
step) with its arrays, then the token ids rank 0 just sampled, on the model's group: they are on its
device only.
"""

import enum
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist

from tokenmill.distributed import control_group
from tokenmill.runner.graph_runners import GraphPlan
from tokenmill.runner.step_inputs import PackedLayout

STEP_FIELDS = (
    "input_ids",
    "positions",
    "seq_lens",
    "seq_order",
    "query_start_loc",
    "sample_rows",
    "slot_mapping",
    "block_tables",
    "token_rows",  # START_NEXT: the rows of the sampled tokens its sequences take
)
_DTYPES = (torch.int64, torch.int32)
_FIELD_WORDS = 3  # per field: dtype code (-1: absent), rows, columns (-1: a flat array)
HEADER_LEN = 4 + _FIELD_WORDS * len(STEP_FIELDS)


class Command(enum.IntEnum):
    FORWARD = 1
    LOGITS = 2
    SHUTDOWN = 3
    SETUP = 4  # once, before the first step: the resolved max_model_len (then every rank sizes its pool)
    GRAPHS = 5  # once, where graph runners are used: their plan; every rank then captures
    DECODE_GRAPH = 6  # a decode step of this many padded rows, through the decode graph runner
    START_NEXT = 7  # an overlapped decode step, fed the tokens rank 0 sampled
    PREFILL_GRAPH = 8  # one sequence's prefill in this token bucket, through the prefill graph runner
    PROFILE = 9  # start (1) or stop (0) the profiler; the trace directory follows as bytes


class StepSender:
    """Rank 0's side: announces each forward pass and each logits computation to the workers. ``device``:
    the model's, where tensors on the model's group live."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def forward(self, arrays: Mapping[str, np.ndarray], max_query_len: int, max_seq_len: int) -> None:
        _send_step(Command.FORWARD, arrays, max_query_len, max_seq_len)

    def decode_step(self, arrays: Mapping[str, np.ndarray], num_rows: int) -> None:
        _send_step(Command.DECODE_GRAPH, arrays, num_rows)

    def start_next_step(
        self, arrays: Mapping[str, np.ndarray], num_rows: int, token_ids: torch.Tensor
    ) -> None:
        _send_step(Command.START_NEXT, arrays, num_rows, len(token_ids))
        dist.broadcast(token_ids.to(torch.int64).contiguous(), 0)

    def prefill_step(self, arrays: Mapping[str, np.ndarray], num_tokens: int) -> None:
        _send_step(Command.PREFILL_GRAPH, arrays, num_tokens)

    def set_up_graphs(self, plan: GraphPlan) -> None:
        header = [0] * HEADER_LEN
        decode, prefill = plan.decode_sizes, plan.prefill_sizes
        header[:4] = [Command.GRAPHS, len(decode), len(prefill), int(plan.logits_in_graph)]
        _broadcast_header(header)
        dist.broadcast(torch.tensor([*decode, *prefill], dtype=torch.int64, device=self.device), 0)

    def logits(self, hidden: torch.Tensor) -> None:
        header = [0] * HEADER_LEN
        header[:3] = [Command.LOGITS, hidden.shape[0], hidden.shape[1]]
        _broadcast_header(header)
        dist.broadcast(hidden.contiguous(), 0)

    def setup(self, max_model_len: int) -> None:
        header = [0] * HEADER_LEN
        header[:2] = [Command.SETUP, max_model_len]
        _broadcast_header(header)

    def profile(self, start: bool, directory: str) -> None:
        """Start or stop every worker's profiler; returns once they have started, or written their traces
        to ``directory``."""
        encoded = directory.encode()
        header = [0] * HEADER_LEN
        header[:3] = [Command.PROFILE, int(start), len(encoded)]
        _broadcast_header(header)
        dist.broadcast(torch.frombuffer(bytearray(encoded), dtype=torch.uint8), 0, group=control_group())
        dist.barrier(group=control_group())

    def shutdown(self) -> None:
        header = [0] * HEADER_LEN
        header[0] = Command.SHUTDOWN
        _broadcast_header(header)


def _send_step(command: Command, arrays: Mapping[str, np.ndarray], first: int, second: int = 0) -> None:
    """A header (``command``, its two arguments, each array's dtype and shape), then the arrays of
    :data:`STEP_FIELDS` packed into one buffer."""
    header = [0] * HEADER_LEN
    header[:3] = [command, first, second]
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


def _broadcast_header(values: list[int]) -> None:
    dist.broadcast(torch.tensor(values, dtype=torch.int64), 0, group=control_group())


def receive_header() -> list[int]:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, 0, group=control_group())
    values: list[int] = header.tolist()
    return values


def receive_text(header: list[int]) -> str:
    """The text after a ``PROFILE`` header (its length is the header's third value)."""
    buffer = torch.empty(header[2], dtype=torch.uint8)
    dist.broadcast(buffer, 0, group=control_group())
    return bytes(buffer.tolist()).decode()


def profile_done() -> None:
    """A worker's side of :meth:`StepSender.profile`'s closing barrier."""
    dist.barrier(group=control_group())


def receive_step_arrays(header: list[int]) -> dict[str, torch.Tensor]:
    """The step's integer inputs, on the host, in their shapes (after a ``FORWARD``, ``DECODE_GRAPH``,
    ``START_NEXT`` or ``PREFILL_GRAPH`` header)."""
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


def receive_graph_plan(header: list[int], device: torch.device) -> GraphPlan:
    """The graph runners' plan (after a ``GRAPHS`` header)."""
    num_decode, num_prefill, logits_in_graph = header[1:4]
    sizes = torch.empty(num_decode + num_prefill, dtype=torch.int64, device=device)
    dist.broadcast(sizes, 0)
    values: list[int] = sizes.tolist()
    return GraphPlan(tuple(values[:num_decode]), tuple(values[num_decode:]), bool(logits_in_graph))


def receive_token_ids(header: list[int], device: torch.device) -> torch.Tensor:
    """The token ids rank 0 sampled, on ``device`` (after a ``START_NEXT`` header and its arrays)."""
    token_ids = torch.empty(header[2], dtype=torch.int64, device=device)
    dist.broadcast(token_ids, 0)
    return token_ids


def receive_hidden(header: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The hidden rows whose logits rank 0 computes (after a ``LOGITS`` header)."""
    hidden = torch.empty(header[1], header[2], dtype=dtype, device=device)
    dist.broadcast(hidden, 0)
    return hidden
