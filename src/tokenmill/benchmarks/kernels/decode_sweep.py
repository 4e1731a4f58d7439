"""Decode attention replayed from CUDA graphs over split counts and tiles, to tune ``plan_decode_split``
and ``default_decode_config``; and where an eager decode call spends its host time.

Every graph is captured with ``max_seq_len`` = the largest context (as the engine's decode graphs are,
with ``max_model_len``), so a row's context may be shorter than the bound its launch was planned for.
"""

import cProfile
import functools
import io
import pstats
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.benchmarks.kernels.attention import AttentionInputs, paged_batch
from tokenmill.benchmarks.kernels.cases import relative_difference
from tokenmill.benchmarks.kernels.shapes import ModelShape
from tokenmill.benchmarks.kernels.timing import Timer
from tokenmill.benchmarks.report import markdown_table
from tokenmill.kernels.attention import (
    DecodeConfig,
    DecodeSplit,
    default_decode_config,
    paged_decode_attention,
    plan_decode_split,
)

BATCHES = (1, 8, 64, 256)
CONTEXTS = (128, 1024, 8192)
SPLITS = (1, 2, 4, 8, 16, 32, 64)
CONFIGS = (
    DecodeConfig(64, 4, 2),
    DecodeConfig(32, 4, 2),
    DecodeConfig(128, 4, 2),
    DecodeConfig(64, 2, 2),
    DecodeConfig(64, 8, 2),
    DecodeConfig(64, 4, 3),
)
TOLERANCE = 2e-2


@dataclass
class SweepRow:
    batch: int
    context: int
    config: DecodeConfig
    times: dict[int, float | None]  # splits -> graph seconds (None: wrong output)


def decode_sweep(
    timer: Timer,
    device: torch.device,
    dtype: torch.dtype,
    batches: Sequence[int] = BATCHES,
    contexts: Sequence[int] = CONTEXTS,
) -> tuple[list[SweepRow], dict[tuple[int, int], float | None]]:
    """Rows of graph times per split count, and the default plan's time per (batch, context)."""
    shape, bound = ModelShape(), max(contexts)
    rows: list[SweepRow] = []
    defaults: dict[tuple[int, int], float | None] = {}
    for batch in batches:
        for context in contexts:
            inputs = paged_batch(shape, [context] * batch, [1] * batch, dtype, device)
            reference = _decode(inputs, bound)
            defaults[batch, context] = timer.graphed(functools.partial(_decode, inputs, bound))
            for config in CONFIGS:
                times = {
                    splits: _timed_if_right(timer, inputs, bound, reference, config, splits)
                    for splits in SPLITS
                }
                rows.append(SweepRow(batch, context, config, times))
            print(f"  decode sweep B={batch} ctx={context}", flush=True)
            del inputs, reference
    return rows, defaults


def _decode(
    inputs: AttentionInputs,
    bound: int,
    config: DecodeConfig | None = None,
    split: DecodeSplit | None = None,
) -> torch.Tensor:
    assert inputs.cache is not None and inputs.metadata.block_tables is not None
    return paged_decode_attention(
        inputs.query,
        inputs.cache.key,
        inputs.cache.value,
        inputs.metadata.block_tables,
        inputs.metadata.seq_lens,
        bound,
        inputs.layer.scale,
        config=config,
        split=split,
    )


def _timed_if_right(
    timer: Timer,
    inputs: AttentionInputs,
    bound: int,
    reference: torch.Tensor,
    config: DecodeConfig,
    splits: int,
) -> float | None:
    split = DecodeSplit(splits, config.block_n)
    if relative_difference(_decode(inputs, bound, config, split), reference) > TOLERANCE:
        return None
    return timer.graphed(lambda: _decode(inputs, bound, config, split))


def format_sweep(rows: Sequence[SweepRow], defaults: dict[tuple[int, int], float | None]) -> str:
    headers = ["B", "ctx", "block_n/warps/stages", *(f"{s} splits" for s in SPLITS), "best", "default"]
    lines = []
    for row in rows:
        valid = {s: t for s, t in row.times.items() if t is not None}
        best = min(valid, key=lambda s: valid[s]) if valid else None
        cells = [_us(t) if t is not None else "WRONG" for t in row.times.values()]
        default = defaults[row.batch, row.context]
        best_cell = f"{best} ({_us(valid[best])})" if best else "-"
        config = "/".join(str(value) for value in row.config if value is not None)
        lines.append([str(row.batch), str(row.context), config, *cells, best_cell, _us(default)])
    return markdown_table(headers, lines)


def default_plans(device: torch.device, dtype: torch.dtype, batches: Sequence[int], bound: int) -> str:
    shape = ModelShape()
    config = default_decode_config(shape.head_dim, dtype)
    plans = [f"B={b}: {plan_decode_split(b, shape.kv_heads, bound, device, config.block_n)}" for b in batches]
    return f"default config {config}; plans at bound {bound}: " + ", ".join(plans)


def profile_decode_host(
    device: torch.device, dtype: torch.dtype, context: int = 1024, calls: int = 300
) -> str:
    """cProfile of back-to-back eager decode calls (write_kv + attention, B = 1): the host's share."""
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    inputs = paged_batch(ModelShape(), [context], [1], dtype, device)
    backend = TritonAttentionBackend()

    def call() -> object:
        return backend.forward(
            inputs.layer, inputs.query, inputs.key, inputs.value, inputs.metadata, inputs.cache
        )

    call()
    torch.cuda.synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize(device)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"
