"""Grammar-backend costs without the model: building the token tables, compiling, and per decode step
filling a batch's bitmasks (the host work the engine does while the device runs the forward), advancing
its matchers, and applying the masks to ``[B, vocab]`` logits on the device.

The batch follows the nested schema's example instance token by token, every row at the same place; each
token must be allowed by the mask just filled, and accepted, or the timing fails.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.benchmarks.stats import median, percentile
from tokenmill.benchmarks.structured.schemas import COMPILED, instance_text
from tokenmill.kernels.options import resolve_kernel_toggle
from tokenmill.structured.backend import GrammarBackend, GrammarMatcher, Vocabulary
from tokenmill.structured.bitmask import apply_token_bitmask
from tokenmill.structured.manager import create_backend
from tokenmill.tokenizer import Tokenizer

APPLY_REPEATS = 20


@dataclass
class StepTimes:
    """Per decode step at one batch size, in microseconds: median and p99."""

    fill: tuple[float, float]
    advance: tuple[float, float]
    apply: float  # median on the device (synchronised), the Triton kernel on CUDA
    steps: int


@dataclass
class MaskTimings:
    backend: str
    vocab_size: int
    tables_s: float  # building the backend for the tokenizer (token tables)
    compile_ms: dict[str, float] = field(default_factory=dict)
    steps: dict[int, StepTimes] = field(default_factory=dict)  # batch size -> times


def time_masks(
    name: str,
    tokenizer: Tokenizer,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    device: torch.device,
    batch_sizes: Sequence[int],
) -> MaskTimings:
    start = time.perf_counter()
    backend = create_backend(name, Vocabulary(tokenizer.hf_tokenizer, vocab_size, tuple(eos_token_ids)))
    timings = MaskTimings(name, vocab_size, time.perf_counter() - start)
    for label, params in COMPILED.items():
        start = time.perf_counter()
        backend.compile(params.spec())
        timings.compile_ms[label] = (time.perf_counter() - start) * 1e3
    tokens = tokenizer.encode(instance_text(), add_special_tokens=False)
    for batch in batch_sizes:
        timings.steps[batch] = _time_steps(backend, tokens, batch, device)
    return timings


def _time_steps(backend: GrammarBackend, tokens: list[int], batch: int, device: torch.device) -> StepTimes:
    grammar = backend.compile(COMPILED["nested schema"].spec())
    rows: list[tuple[GrammarMatcher, int]] = [(grammar.matcher(), row) for row in range(batch)]
    bitmask = torch.zeros((batch, backend.width), dtype=torch.int32)
    fills, advances = [], []
    for position, token in enumerate(tokens):
        start = time.perf_counter()
        backend.fill_bitmasks(rows, bitmask)
        fills.append(time.perf_counter() - start)
        if not (int(bitmask[-1, token // 32]) >> (token % 32)) & 1:
            raise RuntimeError(
                f"{backend.name}: the mask forbids token {token} of the instance at {position}"
            )
        start = time.perf_counter()
        accepted = all(matcher.accept_token(token) for matcher, _ in rows)
        advances.append(time.perf_counter() - start)
        if not accepted:
            raise RuntimeError(f"{backend.name}: token {token} of the instance refused at {position}")
    return StepTimes(
        (median(fills) * 1e6, percentile(fills, 99) * 1e6),
        (median(advances) * 1e6, percentile(advances, 99) * 1e6),
        _time_apply(bitmask, backend.vocab_size, device) * 1e6,
        len(tokens),
    )


def _time_apply(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> float:
    """Median seconds to mask ``[B, vocab]`` float32 logits on ``device``."""
    apply = apply_token_bitmask
    if resolve_kernel_toggle("sampling", None, device):
        from tokenmill.kernels.token_bitmask import apply_token_bitmask as apply
    logits = torch.randn((bitmask.shape[0], vocab_size), device=device)
    on_device = bitmask.to(device)
    times = []
    for _ in range(APPLY_REPEATS):
        _synchronize(device)
        start = time.perf_counter()
        apply(logits, on_device)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
