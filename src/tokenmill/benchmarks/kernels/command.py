"""Kernel benchmark: each Triton kernel against the PyTorch code it replaces, at Llama-3.2-1B shapes.

Every kernel is first checked against its reference on the same inputs; a kernel whose output differs
is reported WRONG and not timed. Times are medians of ``triton.testing.do_bench`` (L2 flushed before
each run; while the flush runs on the GPU the host queues the timed launches, so for calls whose host
work is shorter than the flush this is GPU time). ``graph us`` replays the call from a CUDA graph, as the
engine's decode graphs do (decode attention captured with ``max_seq_len`` = the largest context, as
the engine captures with ``max_model_len``, 16 calls per graph on separate KV pools like a 16-layer
model's, time per call); ``host us`` is the host time per call of back-to-back eager
calls: the launch cost an eager step pays. GB/s counts the bytes a kernel must move at least (read once,
written once), shown against a device-to-device copy measured in the same run; prefill rows give
TFLOP/s instead. The attention peer is torch SDPA on contiguous, unpaged K/V: the speed of light for a
kernel that reads a paged cache.

Further sections: the small-batch projections (``kernels.gemv``), the sampler step (``kernels.sampler``),
the model layers on the fused kernels against PyTorch (``kernels.fused_model``) and, with
``--decode-sweep``, decode attention under CUDA graphs over split counts and tiles
(``kernels.decode_sweep``, to tune ``plan_decode_split``).

    python -m tokenmill.benchmarks.kernels [--dtype bfloat16] [--quick] [--sweep] [--json PATH]

``--smoke`` runs tiny shapes with wall-clock timing; with ``TRITON_INTERPRET=1 ... --device cpu`` it
checks the script itself on a machine without a GPU.
"""

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict

import torch

from tokenmill.benchmarks.arguments import add_kernels_arguments as add_arguments
from tokenmill.benchmarks.common import run_as_script
from tokenmill.benchmarks.kernels.attention import decode_cases, prefill_cases, sweep_cases
from tokenmill.benchmarks.kernels.cases import format_rows, run_all
from tokenmill.benchmarks.kernels.elementwise import elementwise_cases
from tokenmill.benchmarks.kernels.shapes import FULL, QUICK, SMOKE, ModelShape, Sizes
from tokenmill.benchmarks.kernels.timing import Timer, copy_bandwidth
from tokenmill.benchmarks.report import detect_hardware, provenance
from tokenmill.engine.hardware_defaults import resolve_device
from tokenmill.kernels import triton_available

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
COPY_BYTES = 1 << 30


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)  # a bad name, or CUDA where there is none, is a ValueError
    if not triton_available(device):
        print(f"tokenmill bench kernels: triton cannot run on {device} here", file=sys.stderr)
        return 1
    dtype = DTYPES[args.dtype]
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    shape = ModelShape()
    timer = Timer(device, args.warmup_ms, args.rep_ms)
    origin = provenance(detect_hardware(device))
    print(origin.markdown() + _header(device, dtype, shape), flush=True)
    copy_bytes_per_s = copy_bandwidth(timer, device, COPY_BYTES if not args.smoke else 1 << 20)
    print(f"- device-to-device copy: {copy_bytes_per_s / 1e9:.0f} GB/s (read + write)", flush=True)
    cases = elementwise_cases(shape, sizes, dtype, device)
    cases += decode_cases(shape, sizes, dtype, device) + prefill_cases(shape, sizes, dtype, device)
    if args.only:
        cases = [c for c in cases if args.only in c.kernel]
    rows = run_all(cases, timer, dtype, device) if not args.no_kernels else []
    if rows:
        print("\n" + format_rows(rows, copy_bytes_per_s), flush=True)
    wrong = _extra_sections(args, timer, device, dtype, sizes)
    if args.sweep:
        sweep = [
            c for c in sweep_cases(shape, sizes, dtype, device) if not args.only or args.only in c.kernel
        ]
        sweep_rows = run_all(sweep, timer, dtype, device)
        print("\nTile sweep (defaults: tokenmill/kernels/attention/plan.py)\n", flush=True)
        print(format_rows(sweep_rows, copy_bytes_per_s), flush=True)
        rows += sweep_rows
    if args.json is not None:
        payload = {
            "provenance": origin.to_json(),
            "copy_bytes_per_s": copy_bytes_per_s,
            "dtype": args.dtype,
            "rows": [asdict(r) for r in rows],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    wrong += [f"{r.kernel} [{r.shape}] {r.status}" for r in rows if r.status != "ok"]
    for line in wrong:
        print(f"error: {line}", file=sys.stderr)
    return 1 if wrong else 0


def _extra_sections(
    args: argparse.Namespace, timer: Timer, device: torch.device, dtype: torch.dtype, sizes: Sizes
) -> list[str]:
    """The host profiles, decode sweep, sampler and fused-model sections, each on its own (one that
    fails is reported and the next still runs); returns what failed its check."""
    sections: list[tuple[str, bool, Callable[[], list[str]]]] = [
        ("host profile", args.profile_host and device.type == "cuda", lambda: _host_profiles(device, dtype)),
        (
            "decode sweep",
            args.decode_sweep and device.type == "cuda",
            lambda: _decode_sweep(timer, device, dtype),
        ),
        ("gemv", not args.no_gemv, lambda: _gemv_section(timer, device, dtype, sizes, args.gemv_sweep)),
        ("sampler", not args.no_sampler, lambda: _sampler_section(timer, device, sizes)),
        ("fused model", not args.no_model and device.type == "cuda", lambda: _model_section(timer, device)),
    ]
    wrong: list[str] = []
    for name, wanted, section in sections:
        if not wanted:
            continue
        try:
            wrong += section()
        except Exception:  # report it; the other sections still run
            print(f"\n{name} section failed:\n{traceback.format_exc()}", flush=True)
            wrong.append(f"{name} section raised")
    return wrong


def _host_profiles(device: torch.device, dtype: torch.dtype) -> list[str]:
    from tokenmill.benchmarks.kernels import decode_sweep, sampler

    print("\nHost profile of eager decode calls (B=1)\n\n" + decode_sweep.profile_decode_host(device, dtype))
    profile = sampler.profile_sampler_host(device, sampler.SamplingParams(temperature=0.8))
    print("\nHost profile of fused sampler steps (B=1, temperature)\n\n" + profile, flush=True)
    return []


def _decode_sweep(timer: Timer, device: torch.device, dtype: torch.dtype) -> list[str]:
    from tokenmill.benchmarks.kernels import decode_sweep

    rows, defaults = decode_sweep.decode_sweep(timer, device, dtype)
    print("\n" + decode_sweep.default_plans(device, dtype, decode_sweep.BATCHES, max(decode_sweep.CONTEXTS)))
    print(
        "\nDecode attention under CUDA graphs (us)\n\n" + decode_sweep.format_sweep(rows, defaults),
        flush=True,
    )
    return []


def _gemv_section(
    timer: Timer, device: torch.device, dtype: torch.dtype, sizes: Sizes, sweep: bool
) -> list[str]:
    from tokenmill.benchmarks.kernels import gemv

    copy_bytes_per_s = copy_bandwidth(timer, device, COPY_BYTES if sizes is not SMOKE else 1 << 20)
    if sizes is SMOKE:
        models = [gemv.Projection("tiny", name, 40, 96, prologue) for name, prologue in SMOKE_GEMV]
        rows = gemv.gemv_rows(timer, device, dtype, (1,), models)
    else:
        rows = gemv.gemv_rows(timer, device, dtype)
    table = gemv.format_gemv_rows(rows, copy_bytes_per_s, dtype)
    print("\nSmall-batch projections (fused_gemv), per layer in CUDA graphs\n\n" + table, flush=True)
    if sweep:
        sweep_rows = gemv.sweep_rows(timer, device, dtype)
        table = gemv.format_gemv_rows(sweep_rows, copy_bytes_per_s, dtype)
        print("\nGEMV tile sweep (llama-3.2-1b, M=1)\n\n" + table, flush=True)
    return [f"gemv {r.projection.name} M={r.rows} {r.status}" for r in rows if r.status != "ok"]


SMOKE_GEMV = (("qkv_proj", "add_rms_norm"), ("o_proj", "none"), ("down_proj", "silu"))


def _sampler_section(timer: Timer, device: torch.device, sizes: Sizes) -> list[str]:
    from tokenmill.benchmarks.kernels import sampler

    smoke = sizes is SMOKE
    vocab = 1000 if smoke else sampler.VOCAB
    rows = sampler.sampler_rows(timer, device, (1, 3) if smoke else sampler.BATCHES, vocab)
    print(f"\nSampler step, vocab {vocab}\n\n" + sampler.format_sampler_rows(rows), flush=True)
    return [f"sampler {r.params} B={r.batch} {r.status}" for r in rows if r.status != "ok"]


def _model_section(timer: Timer, device: torch.device) -> list[str]:
    from tokenmill.benchmarks.kernels import fused_model

    rows = fused_model.fused_model_rows(timer, device)
    print(
        "\nFused layer kernels in real model shapes\n\n" + fused_model.format_model_rows(rows),
        flush=True,
    )
    return [f"fused model {r.preset} {r.dtype} {r.status}" for r in rows if r.status != "ok"]


def _header(device: torch.device, dtype: torch.dtype, shape: ModelShape) -> str:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    return "\n".join(
        [
            "# Triton kernels vs PyTorch",
            "",
            f"- device: {name}; torch {torch.__version__}, triton {triton.__version__}, {dtype}",
            f"- shapes: {shape}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    return run_as_script("kernels", __doc__, add_arguments, run, argv)
