"""Argument types of the benchmarks' flags, so that a bad value is refused while the command line is parsed,
before a model loads or a workload runs (no torch here)."""

import argparse
import os
from pathlib import Path


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def positive_float(text: str) -> float:
    return _float_beyond(text, 0.0, inclusive=False)


def non_negative_float(text: str) -> float:
    return _float_beyond(text, 0.0, inclusive=True)


def _float_beyond(text: str, low: float, inclusive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not (value >= low if inclusive else value > low):  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be {'at least' if inclusive else '>'} {low:g}, got {text}")
    return value


def report_dir(text: str) -> Path:
    """A folder the report can be written to: a directory, or a path whose nearest existing parent is a
    writable directory (checked now, so a finished benchmark does not lose its report)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"'{text}' exists and is not a directory")
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"'{text}' cannot be created: '{existing}' is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"'{text}' cannot be written: '{existing}' is not writable")
    return path
