"""One row of the kernel table: a kernel and its PyTorch reference on the same inputs, checked first and
timed only when they agree; and the table of the rows."""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.benchmarks.kernels.timing import Timer
from tokenmill.benchmarks.report import markdown_table

Outputs = torch.Tensor | tuple[torch.Tensor, ...]
# Largest relative (Frobenius) difference from the reference that still counts as correct.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
GRAPH_LAYERS = 16  # Llama-3.2-1B's layer count: one graph replays this many decode attention calls
GRAPH_INPUT_BYTES = 4 << 30


@dataclass
class Case:
    """One benchmark row: ``make_inputs`` builds fresh (seeded) inputs; the functions run on them."""

    kernel: str
    shape: str
    make_inputs: Callable[[], Any]
    triton_fn: Callable[[Any], Outputs]
    reference_fn: Callable[[Any], Outputs]
    bytes_moved: int = 0
    flops: int = 0
    peer: Callable[[], Callable[[], object]] | None = None  # builds a timed peer call
    time_reference: bool = True
    # Inputs for the CUDA-graph timing, when they differ from make_inputs' (decode: a max_seq_len bound).
    graph_inputs: Callable[[Any], Any] | None = None


@dataclass
class Row:
    kernel: str
    shape: str
    status: str = "ok"
    triton_s: float | None = None
    torch_s: float | None = None
    peer_s: float | None = None
    graph_s: float | None = None  # the Triton call replayed from a CUDA graph
    host_s: float | None = None  # host time per eager Triton call, back to back
    bytes_moved: int = 0
    flops: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def relative_difference(ours: Outputs, reference: Outputs) -> float:
    pairs = zip(_as_tuple(ours), _as_tuple(reference), strict=True)
    worst = 0.0
    for a, b in pairs:
        if a.shape != b.shape:
            return math.inf
        diff = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)
        worst = max(worst, float(diff))
    return worst


def _as_tuple(outputs: Outputs) -> tuple[torch.Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def run_case(case: Case, timer: Timer, dtype: torch.dtype) -> Row:
    row = Row(case.kernel, case.shape, bytes_moved=case.bytes_moved, flops=case.flops)
    difference, times = _check_then_time(case, timer, dtype)
    row.extra["relative_difference"] = difference
    if times is None:
        row.status = f"WRONG ({difference:.1e})"
        return row
    row.triton_s, row.torch_s = times
    if case.graph_inputs is not None:
        row.graph_s = _graphed_per_layer(case, timer)
        inputs = case.graph_inputs(case.make_inputs())
        row.host_s = timer.host(lambda: case.triton_fn(inputs))
        del inputs
    if case.peer is not None:  # after the inputs above are freed
        row.peer_s = timer(case.peer())
    return row


def _graphed_per_layer(case: Case, timer: Timer) -> float | None:
    """Seconds per call in a graph of ``GRAPH_LAYERS`` calls on separate inputs (as a model's layers
    run, each on its own KV), which spreads the graph's launch over them; one call when that many
    copies of the inputs would not fit ``GRAPH_INPUT_BYTES``."""
    assert case.graph_inputs is not None
    layers = GRAPH_LAYERS if case.bytes_moved * GRAPH_LAYERS <= GRAPH_INPUT_BYTES else 1
    copies = [case.graph_inputs(case.make_inputs()) for _ in range(layers)]

    def all_layers() -> None:
        for inputs in copies:
            case.triton_fn(inputs)

    seconds = timer.graphed(all_layers)
    return seconds / layers if seconds is not None else None


def _check_then_time(
    case: Case, timer: Timer, dtype: torch.dtype
) -> tuple[float, tuple[float, float | None] | None]:
    """The relative difference from the reference, and (Triton, reference) seconds if it is small."""
    ours, theirs = case.make_inputs(), case.make_inputs()
    difference = relative_difference(case.triton_fn(ours), case.reference_fn(theirs))
    if not difference <= TOLERANCE[dtype]:
        return difference, None
    triton_s = timer(lambda: case.triton_fn(ours))
    reference_s = timer(lambda: case.reference_fn(theirs)) if case.time_reference else None
    return difference, (triton_s, reference_s)


def run_all(cases: Sequence[Case], timer: Timer, dtype: torch.dtype, device: torch.device) -> list[Row]:
    rows = []
    for case in cases:
        started = time.perf_counter()
        try:
            row = run_case(case, timer, dtype)
        except torch.OutOfMemoryError:
            row = Row(case.kernel, case.shape, status="out of memory")
        rows.append(row)
        _release(device)
        took = time.perf_counter() - started
        print(f"  {case.kernel:28s} {case.shape:40s} {row.status:8s} ({took:.1f} s)", flush=True)
    return rows


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_rows(rows: Sequence[Row], copy_bytes_per_s: float) -> str:
    headers = [
        "kernel",
        "shape",
        "check",
        "triton us",
        "graph us",
        "host us",
        "torch us",
        "speedup",
        "sdpa us",
        "GB/s",
        "% copy",
        "TFLOP/s",
    ]
    lines = []
    for row in rows:
        fastest = min((t for t in (row.triton_s, row.graph_s) if t), default=None)
        gbps = row.bytes_moved / fastest / 1e9 if fastest and row.bytes_moved else None
        is_prefill = "prefill" in row.kernel or "varlen" in row.kernel
        lines.append(
            [
                row.kernel,
                row.shape,
                row.status,
                _us(row.triton_s),
                _us(row.graph_s),
                _us(row.host_s),
                _us(row.torch_s),
                f"{row.torch_s / row.triton_s:.2f}x" if row.triton_s and row.torch_s else "-",
                _us(row.peer_s),
                "-" if gbps is None or is_prefill else f"{gbps:.0f}",
                "-" if gbps is None or is_prefill else f"{100 * gbps * 1e9 / copy_bytes_per_s:.0f}%",
                f"{row.flops / row.triton_s / 1e12:.1f}"
                if row.triton_s and row.flops and is_prefill
                else "-",
            ]
        )
    return markdown_table(headers, lines)


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"
