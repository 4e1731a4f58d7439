"""Small C kernels for the CPU, compiled on first use with the system compiler and called through ctypes.

The compiler is the one Inductor uses (``cc``, i.e. ``$CC`` or ``gcc``); each shared object is cached under
``~/.cache/tokenmill/kernels`` by a hash of its source, flags and the CPU's features (``-march=native``
code must not run on another CPU sharing the home directory). :func:`compile_library` returns None where
the library cannot be built, and callers fall back to PyTorch. The libraries link the ``libgomp.so.1``
that torch has already loaded, so their OpenMP loops share torch's thread pool.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from tokenmill.user_cache import tokenmill_cache_dir

logger = logging.getLogger(__name__)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def _cpu_features() -> str:
    try:
        with Path("/proc/cpuinfo").open() as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compiler_available() -> bool:
    return _compiler() is not None


def _build(source: str, flags: tuple[str, ...], target: Path) -> None:
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        path = Path(tmp) / f"{target.stem}.c"
        path.write_text(source)
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(path), "-o", str(built)], check=True, capture_output=True)
        built.replace(target)  # atomic: concurrent builders each install a whole file


def compile_library(name: str, source: str, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The library built from ``source`` (once per source, flags and CPU), or None where it cannot be."""
    digest = hashlib.sha256((source + " ".join(flags) + _cpu_features()).encode()).hexdigest()[:16]
    target = tokenmill_cache_dir("kernels") / f"{name}_{digest}.so"
    try:
        if not target.is_file():
            _build(source, flags, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("C kernel %s unavailable (%s %s); using PyTorch", name, error, detail.decode()[-500:])
        return None
