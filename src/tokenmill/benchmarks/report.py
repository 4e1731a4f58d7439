"""What every benchmark report carries: the hardware, the model, number formatting, tables, files."""

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.loading import LoadedModel


@dataclass(frozen=True)
class Hardware:
    device: str
    name: str
    detail: str

    def describe(self) -> str:
        return f"{self.name} ({self.detail}); torch {torch.__version__}, device {self.device}"


def detect_hardware(device: torch.device) -> Hardware:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        detail = f"{props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}"
        return Hardware(str(device), props.name, detail)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    detail = f"{cores} cores usable of {os.cpu_count()}, torch threads {torch.get_num_threads()}"
    return Hardware(str(device), cpu_model_name(), detail)


def cpu_model_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_model(loaded: LoadedModel) -> str:
    num_params = sum(p.numel() for p in loaded.model.parameters())
    dtype = str(loaded.dtype).removeprefix("torch.")
    return f"{loaded.source} ({loaded.config.architecture}, {num_params / 1e6:.1f} M parameters, {dtype})"


# -- formatting --------------------------------------------------------------------------------------


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def fmt_ms(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:  # None or NaN
        return "-"
    return f"{seconds * 1e3:.1f}"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.2f}x"


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), separator, *(line(row) for row in rows)])


def write_json(path: Path, payload: dict[str, Any], indent: int | None = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, default=str) + "\n")


def header_lines(title: str, workload: str, hardware: Hardware, model: str, peer: str) -> list[str]:
    return [
        f"# {title}",
        "",
        f"- workload: {workload}",
        f"- hardware: {hardware.describe()}",
        f"- model: {model}",
        f"- peer: {peer}",
    ]
