"""Triton fast paths for the hot GPU operations, each with a PyTorch layer as its reference.

The kernel modules import triton when imported; check :func:`triton_available` first and fall back to
the PyTorch layers when it says no. With ``TRITON_INTERPRET=1`` set before triton is imported, the
kernels run on CPU tensors through Triton's interpreter (slow; for tests).
"""

import functools
import importlib.util
import os

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_installed() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (default: anywhere they could run here).

    Compiled kernels need a CUDA device; the interpreter runs on any device's tensors.
    """
    if not triton_installed():
        return False
    if interpreter_enabled():
        return True
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available()


__all__ = ["interpreter_enabled", "triton_available", "triton_installed"]
