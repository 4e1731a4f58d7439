"""Exploration (CPU): the C decode attention and the packed GGUF projection (float32 inputs, with its
prologues) built from an older commit's source and from the working tree, called alternately in one
process on the same inputs at SmolLM2's shapes: µs per call, and whether the outputs agree.

``python scripts/experiments/cpu_kernels_ab.py [old commit] [rounds]`` (default: HEAD, 3 rounds)."""

import ctypes
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from tokenmill.attention import cpu_kernel as attention
from tokenmill.native import compile_library
from tokenmill.quantization import gguf_cpu_kernel as projection
from tokenmill.quantization import gguf_prologue as prologue

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = {"q/k/v + norm": (960, 576, 1), "gate/up + norm": (3072, 576, 1), "down + SiLU": (576, 1536, 2)}


def _old_module(
    commit: str, path: str, drop: str = "", names: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The names an older version of a module defines before its first ``@cache`` function, with the line
    ``drop`` removed and ``names`` defined first (what that line imported, from another old module)."""
    text = subprocess.run(
        ["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    text = text.split("\n\n\n@cache", 1)[0].replace(drop, "")
    namespace: dict[str, Any] = dict(names or {})
    exec(text, namespace)
    return namespace


def _libraries(commit: str) -> dict[str, dict[str, ctypes.CDLL]]:
    old_prologue = _old_module(commit, "src/tokenmill/quantization/gguf_prologue.py")
    old_projection = _old_module(
        commit,
        "src/tokenmill/quantization/gguf_cpu_kernel.py",
        "from tokenmill.quantization.gguf_prologue import FUSED_ARGTYPES, ROW_PROLOGUES",
        {name: old_prologue[name] for name in ("FUSED_ARGTYPES", "ROW_PROLOGUES")},
    )
    old_attention = _old_module(commit, "src/tokenmill/attention/cpu_kernel.py")
    built: dict[str, dict[str, ctypes.CDLL]] = {"old": {}, "new": {}}
    for mode, attention_source, projection_source in (
        ("old", old_attention["_SOURCE"], old_projection["_SOURCE"]),
        ("new", attention._SOURCE, projection._SOURCE),
    ):
        attend = compile_library(f"ab_attention_{mode}", attention_source, attention._FLAGS)
        linear = compile_library(f"ab_linear_{mode}", projection_source)
        if attend is None or linear is None:
            sys.exit("no C compiler")
        linear.gguf_linear_prologue.argtypes = prologue.FUSED_ARGTYPES
        linear.gguf_dequantize.argtypes = projection.load_kernel().gguf_dequantize.argtypes
        attend.decode_attention.argtypes = attention.ARGTYPES
        built[mode] = {"attention": attend, "linear": linear}
    return built


def _attention_call(library: ctypes.CDLL, context: int, threads: int) -> tuple[Any, torch.Tensor]:
    generator = torch.Generator().manual_seed(context)
    blocks = context // BLOCK + 2
    pool = torch.randn(2, blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=generator)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(1, width, generator=generator)
    cos_sin = torch.randn(context + 1, HEAD_DIM, generator=generator)
    table = torch.arange(blocks, dtype=torch.int32)
    position = torch.tensor([context - 1])
    lengths = torch.tensor([context], dtype=torch.int32)
    out = torch.empty(HEADS * HEAD_DIM)
    keep = (pool, qkv, cos_sin, table, position, lengths, out)
    pointer = qkv.data_ptr()
    args = (
        ctypes.c_void_p(pointer), width, ctypes.c_void_p(pointer + HEADS * HEAD_DIM * 4), width,
        ctypes.c_void_p(pointer + (HEADS + KV_HEADS) * HEAD_DIM * 4), width, 1, HEADS, KV_HEADS, HEAD_DIM,
        ctypes.c_void_p(cos_sin.data_ptr()), ctypes.c_void_p(position.data_ptr()),
        ctypes.c_void_p(pool[0].data_ptr()), ctypes.c_void_p(pool[1].data_ptr()), BLOCK,
        ctypes.c_void_p(position.data_ptr()), ctypes.c_void_p(table.data_ptr()), blocks,
        ctypes.c_void_p(lengths.data_ptr()), ctypes.c_float(HEAD_DIM**-0.5), 0,
        ctypes.c_void_p(out.data_ptr()), threads,
    )  # fmt: skip
    return (lambda: library.decode_attention(*args), keep), out


def _linear_call(library: ctypes.CDLL, shape: tuple[int, int, int], threads: int) -> tuple[Any, torch.Tensor]:
    rows, cols, kind = shape
    generator = torch.Generator().manual_seed(rows + cols)
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(rows, cols // 32, generator=generator) * 0.01).half()
    offset = (-torch.rand(rows, cols // 32, generator=generator) * 0.05).half()
    x = torch.randn(1, cols * (2 if kind == prologue.SILU_GATE else 1), generator=generator)
    residual, total = torch.randn(1, cols, generator=generator), torch.empty(1, cols)
    norm = torch.rand(cols, generator=generator)
    out = torch.empty(1, rows)
    keep = (codes, scale, offset, x, residual, total, norm, out)
    args = (
        x.data_ptr(), 1, cols, codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), rows, 32, 1, 1,
        out.data_ptr(), threads, kind, residual.data_ptr() if kind == prologue.RMS_NORM else None,
        total.data_ptr(), norm.data_ptr(), 1e-5, 0,
    )  # fmt: skip
    return (lambda: library.gguf_linear_prologue(*args), keep), out


def _dequantize_call(
    library: ctypes.CDLL, shape: tuple[int, int, int], threads: int
) -> tuple[Any, torch.Tensor]:
    """The float32 weight formed for calls of many rows (``gguf_dequantize``)."""
    rows, cols, _ = shape
    generator = torch.Generator().manual_seed(rows + cols)
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(rows, cols // 32, generator=generator) * 0.01).half()
    offset = (-torch.rand(rows, cols // 32, generator=generator) * 0.05).half()
    out = torch.empty(rows, cols)
    keep = (codes, scale, offset, out)
    args = (
        codes.data_ptr(),
        scale.data_ptr(),
        offset.data_ptr(),
        rows,
        cols,
        32,
        1,
        1,
        out.data_ptr(),
        threads,
    )
    return (lambda: library.gguf_dequantize(*args), keep), out


def _time(call: Any, seconds: float = 0.3) -> float:
    call()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        call()
        count += 1
    return (time.perf_counter() - start) / count * 1e6


def main() -> None:
    commit = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    libraries = _libraries(commit)
    cases: list[tuple[str, str, Any]] = []
    for threads in (1, 2):
        cases += [
            (f"attention, {n} positions, {threads} thread(s)", "attention", (n, threads))
            for n in (100, 300, 1000)
        ]
        cases += [
            (f"{name}, {threads} thread(s)", "linear", (shape, threads)) for name, shape in SHAPES.items()
        ]
        cases.append(
            (f"gate/up weight formed, {threads} thread(s)", "dequantize", (SHAPES["gate/up + norm"], threads))
        )
    print(f"old = {commit}, new = working tree; µs per call, median of {rounds} alternating rounds")
    for label, kind, params in cases:
        make = {"attention": _attention_call, "linear": _linear_call, "dequantize": _dequantize_call}[kind]
        library = "linear" if kind == "dequantize" else kind
        calls = {mode: make(libraries[mode][library], *params) for mode in ("old", "new")}
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(rounds):
            for mode in ("old", "new"):
                times[mode].append(_time(calls[mode][0][0]))
        old, new = (statistics.median(times[mode]) for mode in ("old", "new"))
        difference = (calls["old"][1] - calls["new"][1]).abs().max().item()
        print(
            f"{label:42s} old {old:8.1f}  new {new:8.1f}  {old / new:5.2f}x  max |old - new| {difference:.2e}"
        )


if __name__ == "__main__":
    main()
