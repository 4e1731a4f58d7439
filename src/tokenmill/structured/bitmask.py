"""Token bitmasks: filled on the host, copied to the device once per step, applied to the logits.

A bitmask row has ``ceil(vocab / 32)`` int32 words; bit ``t % 32`` of word ``t // 32`` allows token ``t``.
A step's constrained rows are filled by the grammar backend and every other row allows everything (all
bits set), so one ``[B, words]`` tensor masks the whole batch. On CUDA the host rows are pinned and
buffers take turns, so a buffer is refilled only once its last copy has run.

Masks ahead (``EngineConfig.structured_masks_ahead``): once the engine has moved the matchers past a
step's tokens, :meth:`BitmaskStaging.fill_ahead` starts filling their next masks on a background thread
(llguidance's fill releases the GIL), while the host reads out the step, schedules the next one and the
device runs its forward pass; the next :meth:`BitmaskStaging.fill` takes those rows instead of filling
them on the step's critical path. A matcher moved again since is filled anew.
"""

import math
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.structured.backend import GrammarBackend, GrammarMatcher


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[B, V]`` with every token whose bit is clear in ``bitmask`` ``[>= B, >= ceil(V/32)]``
    set to -inf (a new tensor). The PyTorch reference of ``tokenmill.kernels.token_bitmask``; on the CPU
    the bits are unpacked by numpy (a quarter of the temporary memory of shifting int32 words)."""
    rows, vocab = logits.shape
    words = bitmask[:rows, : -(-vocab // 32)]
    if logits.device.type == "cpu" and words.device.type == "cpu" and sys.byteorder == "little":
        packed = (
            words.contiguous().numpy().view(np.uint8)
        )  # little-endian: token t is bit t % 8 of byte t // 8
        allowed = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")).view(torch.bool)
        return torch.where(allowed[:, :vocab], logits, torch.tensor(-math.inf, dtype=logits.dtype))
    return apply_by_shifts(logits, words)


def apply_by_shifts(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """:func:`apply_token_bitmask` in PyTorch ops on any device: each word shifted by 0..31."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab]
    return logits.masked_fill(allowed == 0, -math.inf)


class _HostRows:
    """One host buffer of bitmask rows and, on CUDA, the event marking its last copy to the device."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.tensor = torch.empty((rows, width), dtype=torch.int32, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None


@dataclass
class _MasksAhead:
    """Masks being filled in the background: row i of ``host`` for ``matchers[i]``."""

    matchers: list[GrammarMatcher]
    host: _HostRows
    done: "Future[None]"

    def row_of(self) -> dict[int, int]:
        return {id(matcher): row for row, matcher in enumerate(self.matchers)}


class BitmaskStaging:
    """Fills a step's bitmask on the host and hands it to the device."""

    def __init__(self, backend: GrammarBackend, device: torch.device) -> None:
        self.backend = backend
        self.device = device
        self._buffers: list[_HostRows] = []
        self._turn = 0
        self._ahead: _MasksAhead | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.rows_from_ahead = 0  # rows a fill took from masks filled ahead (for tests and benchmarks)

    def fill(self, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
        """The ``[len(matchers), words]`` bitmask on the device: row i from ``matchers[i]``, or all ones
        where it is None. Nothing here waits for the device, except on a buffer whose copy of a few steps
        ago has not run yet."""
        ahead = self._take_ahead()
        constrained = [(matcher, row) for row, matcher in enumerate(matchers) if matcher is not None]
        if ahead is not None and _same_matchers(ahead.matchers, matchers):
            host, rows = ahead.host, ahead.host.tensor[: len(matchers)]  # every row filled ahead
            self.rows_from_ahead += len(matchers)
        else:
            host = self._free_buffer(len(matchers))
            rows = host.tensor[: len(matchers)]
            if len(constrained) < len(matchers):
                rows.fill_(-1)
            if ahead is not None:
                constrained = self._copy_filled_ahead(ahead, constrained, rows)
            if constrained:
                self.backend.fill_bitmasks(constrained, rows)
        if host.copied is None:  # the CPU (read before the next fill), or a device without pinned copies
            return rows.to(self.device)
        on_device = rows.to(self.device, non_blocking=True)
        host.copied.record()
        return on_device

    def fill_ahead(self, matchers: Sequence[GrammarMatcher]) -> None:
        """Start filling the next masks of ``matchers`` (each at its state now) in the background."""
        self._take_ahead()
        if not matchers:
            return
        host = self._free_buffer(len(matchers))
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-masks")
        rows = [(matcher, row) for row, matcher in enumerate(matchers)]
        started = threading.Event()

        def fill() -> None:
            started.set()
            self.backend.fill_bitmasks(rows, host.tensor[: len(matchers)])

        done = self._thread.submit(fill)
        # Hand the thread the GIL now: while this one runs Python, it would wait for it up to the switch
        # interval (5 ms), and then the fill would not run ahead at all. The backend's fill releases it.
        started.wait()
        self._ahead = _MasksAhead(list(matchers), host, done)

    def before_advance(self, matchers: Sequence[GrammarMatcher]) -> None:
        """``matchers`` are about to move: a background fill reading them must end first, and their rows
        filled ahead no longer hold."""
        ahead = self._ahead
        if ahead is None:
            return
        moving = {id(matcher) for matcher in matchers}
        if any(id(filled) in moving for filled in ahead.matchers):
            ahead.done.result()
            ahead.matchers = [m if id(m) not in moving else _MOVED for m in ahead.matchers]

    def _take_ahead(self) -> _MasksAhead | None:
        """The masks filled ahead, once their fill has finished (None when there are none)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.done.result()
        return ahead

    def _copy_filled_ahead(
        self, ahead: _MasksAhead, constrained: list[tuple[GrammarMatcher, int]], rows: torch.Tensor
    ) -> list[tuple[GrammarMatcher, int]]:
        """Copy into ``rows`` the rows of ``constrained`` filled ahead; the ones still to fill."""
        row_of = ahead.row_of()
        found = [(row_of[id(matcher)], row) for matcher, row in constrained if id(matcher) in row_of]
        if found:
            source, target = zip(*found, strict=True)
            rows[list(target)] = ahead.host.tensor[list(source)]
            self.rows_from_ahead += len(found)
        return [(matcher, row) for matcher, row in constrained if id(matcher) not in row_of]

    def _free_buffer(self, num_rows: int) -> _HostRows:
        """The next host buffer of at least ``num_rows`` rows whose last copy to the device has run."""
        if not self._buffers or self._buffers[0].tensor.shape[0] < num_rows:
            capacity = max(num_rows, 2 * self._buffers[0].tensor.shape[0] if self._buffers else 8)
            # On CUDA: one being copied, one filled for this step, one filled ahead for the next.
            count = 3 if self.device.type == "cuda" else 2
            self._buffers = [_HostRows(capacity, self.backend.width, self.device) for _ in range(count)]
        host = self._buffers[self._turn % len(self._buffers)]
        self._turn += 1
        if host.copied is not None:
            host.copied.synchronize()
        return host


class _Moved(GrammarMatcher):
    """Stands in a fill-ahead list for a matcher that moved after its row was filled."""

    def accept_token(self, token_id: int) -> bool:
        raise AssertionError("a placeholder")

    def is_terminated(self) -> bool:
        raise AssertionError("a placeholder")

    def rollback(self, num_tokens: int) -> None:
        raise AssertionError("a placeholder")


_MOVED = _Moved()


def _same_matchers(filled: Sequence[GrammarMatcher], wanted: Sequence[GrammarMatcher | None]) -> bool:
    return len(filled) == len(wanted) and all(a is b for a, b in zip(filled, wanted, strict=True))
