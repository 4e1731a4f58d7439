"""Peak memory while loading a model, against the size of its parameters.

A loader that holds a second full copy of the weights (e.g. a whole state dict, then the model) peaks
near twice the parameter bytes; tokenmill streams one tensor at a time, so the peak should stay close to
the parameters alone. With ``--quantization int8|fp8`` each tensor is quantized as it is stored, so the
peak stays near the quantized size (parameters and scale buffers), not the float model's. On CPU the peak
of anonymous resident memory is sampled (file-backed pages of the memory-mapped checkpoint are not a copy:
the kernel can drop them); on CUDA the allocator's peak is read.

    python -m tokenmill.benchmarks.load_memory --model PATH [--device cuda] [--dtype bfloat16]
        [--quantization int8]
"""

import argparse
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks.arguments import add_load_memory_arguments as add_arguments
from tokenmill.benchmarks.report import detect_hardware, provenance
from tokenmill.engine.hardware_defaults import resolve_device
from tokenmill.loading import load_model


@dataclass(frozen=True)
class LoadMemoryReport:
    model: str
    device: str
    dtype: str
    quantization: str
    param_bytes: int
    peak_bytes: int  # above the baseline before loading
    seconds: float

    @property
    def peak_over_params(self) -> float:
        return self.peak_bytes / self.param_bytes


def anonymous_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon is not reported by this kernel")


class PeakSampler:
    """Samples a memory reading in a background thread, keeping the maximum."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = anonymous_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anonymous_rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_rss_bytes())


def measure_load_memory(
    model: str,
    device: str = "cpu",
    dtype: str = "float32",
    load_format: str = "auto",
    quantization: str = "none",
) -> LoadMemoryReport:
    options: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "load_format": load_format,
        "quantization": quantization,
    }
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        loaded = load_model(model, **options)
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        baseline = anonymous_rss_bytes()
        with PeakSampler() as sampler:
            loaded = load_model(model, **options)
        peak = sampler.peak - baseline
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in loaded.model.buffers())
    return LoadMemoryReport(model, device, dtype, quantization, params + buffers, peak, loaded.load_seconds)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)  # a bad name, or CUDA where there is none, is a ValueError
    report = measure_load_memory(args.model, str(device), args.dtype, args.load_format, args.quantization)
    origin = provenance(detect_hardware(device))
    if args.json:
        payload = {**asdict(report), "peak_over_params": report.peak_over_params}
        print(json.dumps({**payload, "provenance": origin.to_json()}))
        return 0
    print(origin.markdown(), end="")
    quantized = "" if report.quantization == "none" else f", weights {report.quantization}"
    where = f"model {report.model} on {report.device} in {report.dtype}{quantized}"
    print(f"{where}, loaded in {report.seconds:.2f} s")
    print(f"parameters + buffers: {report.param_bytes / 2**20:.1f} MiB")
    print(f"peak while loading:   {report.peak_bytes / 2**20:.1f} MiB ({report.peak_over_params:.2f}x)")
    return 0


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(cli)
    raise SystemExit(run(cli.parse_args()))
