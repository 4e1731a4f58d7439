"""The static input buffers of decode graphs (:class:`DecodeInputs`), refilled before each replay from a
step's host arrays in one non-blocking copy from pinned staging memory (:class:`HostStaging`).

A step's arrays (:meth:`DecodeInputs.step_arrays`, from
:func:`~tokenmill.runner.step_inputs.build_step_arrays`) are what rank 0 writes and, under tensor
parallelism, what its workers receive and write into their own buffers (:meth:`DecodeInputs.write_arrays`).
"""

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.runner.step_inputs import PackedLayout, attention_metadata, build_step_arrays, host_buffer
from tokenmill.scheduler.output import ScheduledChunk

# The static buffers: the step's inputs of one value per row (query_start_loc: one more), the rows of the
# sampled tokens an overlapped step takes, and the block tables last (a step of P rows copies a prefix).
_FLAT_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "seq_order", "query_start_loc")
_LAYOUT_FIELDS = (*_FLAT_FIELDS, "token_rows", "block_tables")


class HostStaging:
    """A pinned host copy of the static buffers' layout, written with numpy and copied in one transfer.
    The event marks when its last copy has run, so it is not overwritten before."""

    def __init__(self, layout: PackedLayout, device: torch.device) -> None:
        self.tensor = host_buffer(layout.nbytes, device).zero_()
        self.views = layout.numpy_views(self.tensor.numpy())
        self.copied = torch.cuda.Event() if device.type == "cuda" else None


class DecodeInputs:
    """Static device buffers for decode steps of up to ``capacity`` sequences, in one allocation laid out
    so that a step of ``P`` rows is refreshed by copying one prefix of it (block tables last). Two pinned
    staging buffers take turns, so one can be filled while the other's copy is pending."""

    def __init__(self, capacity: int, table_width: int, device: torch.device) -> None:
        self.capacity = capacity
        self.table_width = table_width
        sizes = {"query_start_loc": capacity + 1, "block_tables": capacity * table_width}
        dtypes = dict.fromkeys(("seq_lens", "seq_order", "query_start_loc", "block_tables"), torch.int32)
        self.layout = PackedLayout(
            [(name, dtypes.get(name, torch.int64), sizes.get(name, capacity)) for name in _LAYOUT_FIELDS]
        )
        self.buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        self.views = self.layout.views(self.buffer)
        self.views["block_tables"] = self.views["block_tables"].view(capacity, table_width)
        self.views["seq_order"].copy_(torch.arange(capacity))  # a permutation before the first step, too
        self._staging = [HostStaging(self.layout, device) for _ in range(2)]
        self._turn = 0

    def view(self, num_rows: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the first ``num_rows`` rows; ``max_seq_len`` is
        a bound, not the step's value."""
        rows = {name: view[: num_rows + (name == "query_start_loc")] for name, view in self.views.items()}
        metadata = attention_metadata(rows, max_query_len=1, max_seq_len=max_seq_len)
        return rows["input_ids"], rows["positions"], metadata

    def write(
        self,
        chunks: Sequence[ScheduledChunk],
        kv: KVCacheManager,
        num_rows: int,
        token_ids: torch.Tensor | None = None,
        token_rows: Sequence[int] | None = None,
    ) -> None:
        """Fill the rows of ``chunks`` and pad the rest up to ``num_rows`` (a graph of ``num_rows`` reads no
        others). The input ids are the sequences' tokens, or ``token_ids`` when given: device tensors,
        copied on the device (the tokens a step just sampled, not yet on the host), those at
        ``token_rows`` when given (the indexes travel with the other inputs, so nothing waits)."""
        arrays = self.step_arrays(chunks, kv, num_rows, token_ids is None, token_rows)
        self.write_arrays(arrays, num_rows, token_ids)

    def step_arrays(
        self,
        chunks: Sequence[ScheduledChunk],
        kv: KVCacheManager,
        num_rows: int,
        with_token_ids: bool = True,
        token_rows: Sequence[int] | None = None,
        full_width: bool = True,
    ) -> dict[str, np.ndarray]:
        """The host arrays of a step over ``chunks`` padded to ``num_rows`` rows (and ``token_rows``): what
        :meth:`write_arrays` takes. Block tables are ``table_width`` wide, or with ``full_width`` off only as
        wide as the step's longest (what travels to tensor-parallel workers each step)."""
        if not len(chunks) <= num_rows <= self.capacity:
            raise ValueError(f"{len(chunks)} sequences do not fit {num_rows} rows of {self.capacity}")
        width = self.table_width if full_width else None
        arrays = build_step_arrays(chunks, kv, num_rows, width, with_token_ids=with_token_ids)
        if token_rows is not None:
            arrays["token_rows"] = np.asarray(token_rows, np.int64)
        return arrays

    def write_arrays(
        self, arrays: Mapping[str, np.ndarray], num_rows: int, token_ids: torch.Tensor | None = None
    ) -> None:
        """Fill the first ``num_rows`` rows from a step's arrays (:meth:`step_arrays`); with ``token_ids``,
        the input ids are those device tensors (at ``arrays["token_rows"]`` when present)."""
        staging = self._staging[self._turn]
        self._turn ^= 1
        if staging.copied is not None:
            staging.copied.synchronize()  # its previous copy has long run: this returns at once
        for name in _FLAT_FIELDS:
            if name in arrays:
                values = arrays[name]
                staging.views[name][: values.size] = values
        if "block_tables" in arrays:
            self._stage_tables(staging.views["block_tables"], arrays["block_tables"], num_rows)
        token_rows = arrays.get("token_rows")
        if token_rows is not None:
            staging.views["token_rows"][: token_rows.size] = token_rows
        nbytes = self.layout.prefix_bytes("block_tables", num_rows * self.table_width)
        self.buffer[:nbytes].copy_(staging.tensor[:nbytes], non_blocking=True)
        if staging.copied is not None:
            staging.copied.record()
        if token_ids is not None:
            count = len(token_ids)
            if token_rows is not None:
                count = token_rows.size
                token_ids = token_ids.index_select(0, self.views["token_rows"][:count])
            self.views["input_ids"][:count].copy_(token_ids, non_blocking=True)

    def _stage_tables(self, staged: np.ndarray, tables: np.ndarray, num_rows: int) -> None:
        """The step's block tables into the staging copy's first ``num_rows`` rows, zero past their width."""
        width = tables.shape[1]
        if width == self.table_width:
            staged[: tables.size] = tables.reshape(-1)
            return
        grid = staged[: num_rows * self.table_width].reshape(num_rows, self.table_width)
        grid[:, :width] = tables
        grid[:, width:] = 0
