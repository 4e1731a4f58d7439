"""What every benchmark report carries: its provenance (commit, command, machine, date), the hardware, the
model, number formatting, tables, plots, and where the files go.

Every Markdown report starts with ``provenance_header``; every plot carries the same in its PNG metadata.
Reports go to ``default_report_dir`` unless ``--report-dir`` says otherwise: never into the source tree
(the committed ``reports/`` is written only when asked for by name).
"""

import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from tokenmill.loading import LoadedModel
from tokenmill.user_cache import tokenmill_cache_dir


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


def client_machine() -> str:
    """This machine for a client-only benchmark (no torch device involved): CPU, cores, Python, OS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cpu_model_name()}, {cores} cores usable; Python {platform.python_version()}, {platform.system()}"
    )


def describe_model(loaded: LoadedModel) -> str:
    """The model's source, architecture, parameter count (packed GGUF weights included; a tied head
    counted once) and dtype, with the quantization it runs in."""
    from tokenmill.quantization.gguf_method import packed_numel

    model = loaded.model
    tied_head = model.lm_head if loaded.config.tie_word_embeddings else None
    packed = sum(packed_numel(module) for module in model.modules() if module is not tied_head)
    num_params = sum(p.numel() for p in model.parameters()) + packed
    dtype = str(loaded.dtype).removeprefix("torch.")
    quantized = "" if loaded.quantization == "none" else f", quantization {loaded.quantization}"
    return (
        f"{loaded.source} ({loaded.config.architecture}, {num_params / 1e6:.1f} M parameters, {dtype}"
        f"{quantized})"
    )


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


def header_lines(title: str, workload: str, model: str, peer: str) -> list[str]:
    """The title and what was run; the machine is in the provenance header above it."""
    return [f"# {title}", "", f"- workload: {workload}", f"- model: {model}", f"- peer: {peer}"]


# -- provenance --------------------------------------------------------------------------------------

UNKNOWN = "unknown"
_PACKAGE = Path(__file__).resolve().parents[1]  # tokenmill/, in a checkout or installed
_GIT_TIMEOUT_S = 10


@dataclass(frozen=True)
class Provenance:
    """Which code, run how, on what, when: enough to rerun a report or tell two apart."""

    commit: str  # short hash, "+dirty" with uncommitted changes, or "unknown"
    command: str  # shell-quoted, as invoked
    machine: str
    date: str  # UTC, ISO 8601

    def markdown(self) -> str:
        """The header a Markdown report starts with: four list lines, then a blank line."""
        fence = "``" if "`" in self.command else "`"
        pad = " " if fence == "``" else ""
        return (
            f"- commit: {self.commit}\n"
            f"- command: {fence}{pad}{self.command}{pad}{fence}\n"
            f"- machine: {self.machine}\n"
            f"- date: {self.date}\n\n"
        )

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    def png_metadata(self) -> dict[str, str]:
        """PNG text chunks (latin-1, as the format wants) carrying the same four facts."""
        chunks = {
            "Software": f"tokenmill {self.commit}",
            "Comment": self.command,
            "Source": self.machine,
            "Creation Time": self.date,
        }
        return {key: value.encode("latin-1", "replace").decode("latin-1") for key, value in chunks.items()}


def provenance(machine: "Hardware | str", argv: Sequence[str] | None = None) -> Provenance:
    """This run's provenance; ``machine`` is the hardware measured on (or a description of it)."""
    described = machine.describe() if isinstance(machine, Hardware) else machine
    return Provenance(
        source_commit(), command_line(argv), described, datetime.now(UTC).isoformat(timespec="seconds")
    )


def provenance_header(machine: "Hardware | str", argv: Sequence[str] | None = None) -> str:
    """What every Markdown report file starts with: commit, command line, machine and date, e.g.::

    - commit: 5454942+dirty
    - command: `tokenmill bench ladder --skip-hf`
    - machine: AMD EPYC (2 cores usable of 2, torch threads 2); torch 2.13.0+cpu, device cpu
    - date: 2026-11-23T10:00:00+00:00
    """
    return provenance(machine, argv).markdown()


def source_commit(package: Path = _PACKAGE) -> str:
    """``git rev-parse --short HEAD`` of the checkout tokenmill runs from, plus "+dirty" when tracked files
    differ from it; "unknown" when tokenmill is not a tracked part of a git checkout (an installed wheel,
    a copy) or git is missing. Never raises. ``TOKENMILL_COMMIT`` names the commit instead, for a copy of
    the tree whose git metadata is missing or stale (a work tree shipped to another machine)."""
    named = os.environ.get("TOKENMILL_COMMIT")
    if named:
        return named
    try:
        _git(package, "ls-files", "--error-unmatch", "__init__.py")  # a checkout, and tokenmill's own
        commit = _git(package, "rev-parse", "--short", "HEAD")
        changes = _git(package, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return UNKNOWN
    return commit + ("+dirty" if changes else "") if commit else UNKNOWN


def _git(directory: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(directory), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=_GIT_TIMEOUT_S,
    )
    return result.stdout.strip()


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as invoked, shell-quoted, the program by its name (``tokenmill bench ladder ...``); run
    as ``python -m`` (or a ``.py`` file), the interpreter's own command line (``python3 -m ...``)."""
    if argv is None:
        module_run = not sys.argv or sys.argv[0] in ("", "-c") or sys.argv[0].endswith(".py")
        argv = sys.orig_argv if module_run else sys.argv
    if not argv:
        return UNKNOWN
    return shlex.join([Path(argv[0]).name, *argv[1:]])


# -- where reports go --------------------------------------------------------------------------------

REPORT_DIR_ENV = "TOKENMILL_REPORT_DIR"


def default_report_dir(name: str) -> Path:
    """Where a benchmark writes ``name`` (e.g. ``ladder-cpu``) when no ``--report-dir`` is given:
    ``$TOKENMILL_REPORT_DIR/<name>`` when that is set, else ``<cache>/tokenmill/reports/<name>`` with
    ``<cache>`` = ``$XDG_CACHE_HOME`` or ``~/.cache``. Not the current directory, which may be the
    repository: the committed ``reports/`` is written only when named (``--report-dir reports/...``)."""
    root = os.environ.get(REPORT_DIR_ENV)
    if root:
        return Path(root).expanduser() / name
    return tokenmill_cache_dir("reports") / name


def report_dir(given: Path | None, name: str) -> Path:
    """``--report-dir`` if given, else the default for ``name``."""
    return given if given is not None else default_report_dir(name)


def device_kind(hardware: Hardware) -> str:
    """``cpu`` or ``cuda`` (no index), as report folders are named."""
    return hardware.device.split(":")[0]


# -- plots -------------------------------------------------------------------------------------------


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(figure: Any, path: Path, dpi: int, origin: Provenance) -> None:
    """Lay ``figure`` out, write it as a PNG carrying ``origin`` in its metadata, and close it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi, metadata=origin.png_metadata())
    plt.close(figure)
