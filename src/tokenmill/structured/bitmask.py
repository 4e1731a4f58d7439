"""Token bitmasks: filled on the host, copied to the device once per step, applied to the logits.

A bitmask row has ``ceil(vocab / 32)`` int32 words; bit ``t % 32`` of word ``t // 32`` allows token ``t``.
A step's constrained rows are filled by the grammar backend and every other row allows everything (all
bits set), so one ``[B, words]`` tensor masks the whole batch. On CUDA the host rows are pinned and two
buffers take turns, so a buffer is refilled only once its last copy has run.
"""

import math
import sys

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


class BitmaskStaging:
    """Fills a step's bitmask on the host and hands it to the device."""

    def __init__(self, backend: GrammarBackend, device: torch.device) -> None:
        self.backend = backend
        self.device = device
        self._buffers: list[_HostRows] = []
        self._turn = 0

    def fill(self, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
        """The ``[len(matchers), words]`` bitmask on the device: row i from ``matchers[i]``, or all ones
        where it is None. Nothing here waits for the device, except on a buffer whose copy of two steps
        ago has not run yet."""
        host = self._next_buffer(len(matchers))
        rows = host.tensor[: len(matchers)]
        if host.copied is not None:
            host.copied.synchronize()
        rows.fill_(-1)
        constrained = [(matcher, row) for row, matcher in enumerate(matchers) if matcher is not None]
        self.backend.fill_bitmasks(constrained, rows)
        if host.copied is None:  # the CPU (read before the next fill), or a device without pinned copies
            return rows.to(self.device)
        on_device = rows.to(self.device, non_blocking=True)
        host.copied.record()
        return on_device

    def _next_buffer(self, num_rows: int) -> _HostRows:
        if not self._buffers or self._buffers[0].tensor.shape[0] < num_rows:
            capacity = max(num_rows, 2 * self._buffers[0].tensor.shape[0] if self._buffers else 8)
            count = 2 if self.device.type == "cuda" else 1
            self._buffers = [_HostRows(capacity, self.backend.width, self.device) for _ in range(count)]
        host = self._buffers[self._turn % len(self._buffers)]
        self._turn += 1
        return host
