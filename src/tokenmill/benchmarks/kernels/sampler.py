"""The sampler step (``SamplingBatch.build`` on the host, then ``Sampler``) at a real vocabulary size, on the
PyTorch draw and on the fused Triton draw (``EngineConfig.fused_sampling``).

Each row is checked first: greedy rows must be the argmax, sampled rows must draw only tokens that the
PyTorch filters keep. ``torch us`` / ``triton us`` time the whole step (do_bench medians); ``host us`` is
the fused step's host time per call, back to back.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.benchmarks.kernels.timing import Timer
from tokenmill.benchmarks.report import markdown_table
from tokenmill.runner.sampler import Sampler, SamplingBatch, SamplingRow, apply_top_k_top_p_min_p
from tokenmill.sampling_params import SamplingParams

VOCAB = 128256  # Llama 3
BATCHES = (1, 64, 256)
HISTORY = 256  # prompt and output ids per row, for the penalties case
PARAMS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-k + min-p": {"temperature": 0.8, "top_k": 50, "min_p": 0.05},
    "top-p": {"temperature": 0.8, "top_p": 0.9},
    "penalties + top-k": {
        "temperature": 0.8,
        "top_k": 50,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
    },
    "seeded": {"temperature": 0.8, "seed": 1},
}


@dataclass
class SamplerRow:
    params: str
    batch: int
    status: str = "ok"
    torch_s: float | None = None
    triton_s: float | None = None
    host_s: float | None = None
    build_s: float | None = None
    torch_graph_s: float | None = None  # the draw alone (batch prebuilt) replayed from a CUDA graph
    triton_graph_s: float | None = None


def sampler_rows(
    timer: Timer, device: torch.device, batches: Sequence[int] = BATCHES, vocab: int = VOCAB
) -> list[SamplerRow]:
    rows = []
    for name, params in PARAMS.items():
        for batch in batches:
            rows.append(_sampler_row(timer, device, name, SamplingParams(**params), batch, vocab))
            print(f"  sampler {name:20s} B={batch:<4d} {rows[-1].status}", flush=True)
    return rows


def _sampler_row(
    timer: Timer, device: torch.device, name: str, params: SamplingParams, batch: int, vocab: int
) -> SamplerRow:
    row = SamplerRow(name, batch)
    generator = torch.Generator(device=device).manual_seed(batch)
    logits = 3 * torch.randn(batch, vocab, generator=generator, device=device)
    history = torch.randint(0, vocab, (batch, 2, HISTORY), generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(params, history[i, 0], history[i, 1]) for i in range(batch)]
    steps = {use: _step(rows, logits, vocab, use) for use in (False, True)}
    row.status = _check(logits, rows, vocab, steps)
    if row.status != "ok":
        return row
    row.torch_s, row.triton_s = timer(steps[False]), timer(steps[True])
    row.host_s = timer.host(steps[True], calls=50)
    row.build_s = timer.host(lambda: SamplingBatch.build(rows, vocab, device), calls=50)
    if params.seed is None:  # seeded rows of the PyTorch draw make generators: not capturable
        prebuilt = SamplingBatch.build(rows, vocab, device)
        row.torch_graph_s = timer.graphed(lambda: Sampler()(logits, prebuilt))
        row.triton_graph_s = timer.graphed(lambda: Sampler(fused=True)(logits, prebuilt))
    return row


def _step(
    rows: Sequence[SamplingRow], logits: torch.Tensor, vocab: int, use_triton: bool
) -> Callable[[], torch.Tensor]:
    sampler = Sampler(fused=use_triton)

    def step() -> torch.Tensor:
        return sampler(logits, SamplingBatch.build(rows, vocab, logits.device)).token_ids

    return step


def _check(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    vocab: int,
    steps: dict[bool, Callable[[], torch.Tensor]],
) -> str:
    batch = SamplingBatch.build(rows, vocab, logits.device)
    if batch.draw is None:
        expected = logits.argmax(dim=-1)
        ok = all(torch.equal(step(), expected) for step in steps.values())
        return "ok" if ok else "WRONG (not the argmax)"
    from tokenmill.runner.sampler import apply_penalties

    processed = apply_penalties(logits, batch)
    scaled = processed / batch.draw.temperature.unsqueeze(1)
    kept = torch.isfinite(apply_top_k_top_p_min_p(scaled, batch) if batch.needs_filtering else scaled)
    for use_triton, step in steps.items():
        tokens = step()
        if not bool(kept.gather(1, tokens.unsqueeze(1)).all()):
            return f"WRONG ({'triton' if use_triton else 'torch'} drew a filtered token)"
    return "ok"


def format_sampler_rows(rows: Sequence[SamplerRow]) -> str:
    headers = ["sampler step", "B", "check", "torch us", "triton us", "speedup", "host us", "build us"]
    headers += ["torch graph us", "triton graph us", "graph speedup"]
    lines = [
        [
            row.params,
            str(row.batch),
            row.status,
            _us(row.torch_s),
            _us(row.triton_s),
            _ratio(row.torch_s, row.triton_s),
            _us(row.host_s),
            _us(row.build_s),
            _us(row.torch_graph_s),
            _us(row.triton_graph_s),
            _ratio(row.torch_graph_s, row.triton_graph_s),
        ]
        for row in rows
    ]
    return markdown_table(headers, lines)


def _ratio(slow: float | None, fast: float | None) -> str:
    return f"{slow / fast:.2f}x" if slow and fast else "-"


def profile_sampler_host(device: torch.device, params: SamplingParams, batch: int = 1) -> str:
    """cProfile of back-to-back fused sampler steps (build included): where the host time goes."""
    import cProfile
    import io
    import pstats

    logits = torch.randn(batch, VOCAB, device=device)
    step = _step([SamplingRow(params)] * batch, logits, VOCAB, use_triton=True)
    step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"
