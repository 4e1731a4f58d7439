"""Small-batch projections (``EngineConfig.fused_gemv``): the Triton GEMV with its fused input step
against what the model runs without it (the fused norm / activation kernel, then cuBLAS via ``F.linear``),
at real model shapes, replayed from CUDA graphs over one weight matrix per layer (so the weights come from
memory, not L2, as in a decode step). A row is timed only if its output matches ``F.linear`` on the same
transformed input. With ``sweep`` the plain GEMV is also timed over tile configurations (to tune
``tokenmill.kernels.gemv.default_gemv_config``).
"""

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.benchmarks.kernels.cases import relative_difference
from tokenmill.benchmarks.kernels.timing import Timer
from tokenmill.benchmarks.report import markdown_table
from tokenmill.kernels.activation import silu_and_mul
from tokenmill.kernels.gemv import GemvConfig, default_gemv_config, gated_gemv, gemv, rms_norm_gemv
from tokenmill.kernels.rmsnorm import add_rms_norm

TOLERANCE = 2e-2
ROWS = (1,)
LAYERS = 16  # weight copies per graph (a decode step reads each layer's weights once)
MAX_GRAPH_WEIGHT_BYTES = 6 << 30
SWEEP_CONFIGS = tuple(
    GemvConfig(block_n, block_k, warps, stages)
    for block_n, block_k, warps, stages in itertools.product(
        (1, 2, 4, 8, 16), (512, 1024, 2048), (2, 4, 8), (1,)
    )
)


@dataclass(frozen=True)
class Projection:
    """One projection of a decoder layer and the step fused before it."""

    model: str
    name: str
    out_features: int
    in_features: int
    prologue: str  # "add_rms_norm", "none" or "silu"


def projections(model: str, hidden: int, intermediate: int, qkv: int) -> list[Projection]:
    return [
        Projection(model, "qkv_proj", qkv, hidden, "add_rms_norm"),
        Projection(model, "o_proj", hidden, hidden, "none"),
        Projection(model, "gate_up_proj", 2 * intermediate, hidden, "add_rms_norm"),
        Projection(model, "down_proj", hidden, intermediate, "silu"),
    ]


MODELS = (
    *projections("llama-3.2-1b", 2048, 8192, 3072),
    *projections("qwen3-0.6b", 1024, 3072, 4096),
    *projections("llama-3.1-8b", 4096, 14336, 6144),
)


@dataclass
class GemvRow:
    projection: Projection
    rows: int
    status: str = "ok"
    triton_s: float | None = None  # fused GEMV, per layer, in a graph
    torch_s: float | None = None  # fused norm / activation kernel + F.linear, per layer, in a graph
    config: GemvConfig | None = None


class _Layer:
    """One layer's inputs and weight for a projection."""

    def __init__(self, projection: Projection, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        width = projection.in_features * (2 if projection.prologue == "silu" else 1)
        self.x = torch.randn(rows, width, dtype=dtype, device=device)
        self.residual = torch.randn(rows, width, dtype=dtype, device=device)
        self.norm_weight = 1 + 0.1 * torch.randn(width, dtype=dtype, device=device)
        scale = projection.in_features**-0.5
        self.weight = scale * torch.randn(
            projection.out_features, projection.in_features, dtype=dtype, device=device
        )


def fused_call(projection: Projection, layer: _Layer, config: GemvConfig | None = None) -> torch.Tensor:
    if projection.prologue == "add_rms_norm":
        return rms_norm_gemv(layer.x, layer.weight, layer.norm_weight, 1e-5, layer.residual, config=config)[0]
    if projection.prologue == "silu":
        return gated_gemv(layer.x, layer.weight, "silu", config=config)
    return gemv(layer.x, layer.weight, config=config)


def unfused_call(projection: Projection, layer: _Layer, keep_residual: bool = False) -> torch.Tensor:
    """What the layers run without ``fused_gemv`` (their other fused kernels on). ``add_rms_norm``
    updates the residual in place: timed calls let it (as the layers do), the check keeps it."""
    if projection.prologue == "add_rms_norm":
        residual = layer.residual.clone() if keep_residual else layer.residual
        return F.linear(add_rms_norm(layer.x, residual, layer.norm_weight, 1e-5)[0], layer.weight)
    if projection.prologue == "silu":
        return F.linear(silu_and_mul(layer.x), layer.weight)
    return F.linear(layer.x, layer.weight)


def gemv_rows(
    timer: Timer,
    device: torch.device,
    dtype: torch.dtype,
    rows: Sequence[int] = ROWS,
    models: Sequence[Projection] = MODELS,
) -> list[GemvRow]:
    results = []
    for projection in models:
        for num_rows in rows:
            results.append(_row(timer, projection, num_rows, dtype, device))
            print(
                f"  gemv {projection.model} {projection.name} M={num_rows} {results[-1].status}", flush=True
            )
    return results


def _row(
    timer: Timer,
    projection: Projection,
    num_rows: int,
    dtype: torch.dtype,
    device: torch.device,
    config: GemvConfig | None = None,
) -> GemvRow:
    layers = _layers(projection, num_rows, dtype, device)
    row = GemvRow(projection, num_rows, config=config)
    difference = relative_difference(
        fused_call(projection, layers[0], config), unfused_call(projection, layers[0], True)
    )
    if not difference <= TOLERANCE:
        row.status = f"WRONG ({difference:.1e})"
        return row
    row.triton_s = _per_layer(
        timer, [functools.partial(fused_call, projection, layer, config) for layer in layers]
    )
    row.torch_s = _per_layer(timer, [functools.partial(unfused_call, projection, layer) for layer in layers])
    return row


def _layers(projection: Projection, num_rows: int, dtype: torch.dtype, device: torch.device) -> list[_Layer]:
    weight_bytes = projection.out_features * projection.in_features * torch.finfo(dtype).bits // 8
    count = max(1, min(LAYERS, MAX_GRAPH_WEIGHT_BYTES // weight_bytes))
    return [_Layer(projection, num_rows, dtype, device) for _ in range(count)]


def _per_layer(timer: Timer, calls: list[Callable[[], torch.Tensor]]) -> float | None:
    def all_layers() -> None:
        for call in calls:
            call()

    seconds = timer.graphed(all_layers) if timer.device.type == "cuda" else timer(all_layers)
    return seconds / len(calls) if seconds is not None else None


def sweep_rows(
    timer: Timer, device: torch.device, dtype: torch.dtype, model: str = "llama-3.2-1b"
) -> list[GemvRow]:
    """The fused GEMV of each projection of ``model`` at one row, over ``SWEEP_CONFIGS``."""
    results = []
    for projection in (p for p in MODELS if p.model == model):
        for config in SWEEP_CONFIGS:
            row = _row(timer, projection, 1, dtype, device, config)
            row.torch_s = None
            results.append(row)
        best = min(
            (r for r in results if r.projection == projection and r.triton_s), key=lambda r: r.triton_s or 0
        )
        print(f"  gemv sweep {projection.name}: best {best.config} {_us(best.triton_s)} us", flush=True)
    return results


def format_gemv_rows(rows: Sequence[GemvRow], copy_bytes_per_s: float, dtype: torch.dtype) -> str:
    headers = ["model", "projection", "fused before", "M", "N x K", "config", "status"]
    headers += ["GEMV us", "% copy bw", "norm/act + cuBLAS us", "% copy bw", "speed-up"]
    table = []
    for row in rows:
        p = row.projection
        weight_bytes = p.out_features * p.in_features * torch.finfo(dtype).bits // 8
        speedup = f"{row.torch_s / row.triton_s:.2f}x" if row.triton_s and row.torch_s else "-"
        config = row.config or default_gemv_config(p.out_features, p.in_features)
        table.append(
            [
                p.model,
                p.name,
                p.prologue,
                str(row.rows),
                f"{p.out_features} x {p.in_features}",
                _config(config),
                row.status,
                _us(row.triton_s),
                _share(weight_bytes, row.triton_s, copy_bytes_per_s),
                _us(row.torch_s),
                _share(weight_bytes, row.torch_s, copy_bytes_per_s),
                speedup,
            ]
        )
    return markdown_table(headers, table)


def _config(config: GemvConfig) -> str:
    return f"n{config.block_n} k{config.block_k} w{config.num_warps} s{config.num_stages}"


def _us(seconds: float | None) -> str:
    return f"{seconds * 1e6:.2f}" if seconds is not None else "-"


def _share(weight_bytes: int, seconds: float | None, copy_bytes_per_s: float) -> str:
    """The weight bytes read per second, as a share of the copy bandwidth (read + write bytes)."""
    return f"{100 * weight_bytes / seconds / copy_bytes_per_s:.0f}%" if seconds else "-"
