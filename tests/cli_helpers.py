"""Running ``tokenmill`` in a fresh interpreter that reports, on stderr, the heavy modules it imported:
flags must be checked before torch is imported."""

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

_RUN_MAIN = """
import sys
from tokenmill.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_info:
    code = exit_info.code
heavy = sorted(name for name in ("torch", "transformers", "numpy") if name in sys.modules)
print("imported:", ",".join(heavy) or "nothing heavy", file=sys.stderr)
sys.exit(code)
"""


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``tokenmill ARGV`` in a fresh interpreter, which reports on stderr the heavy modules it imported."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("TRITON_INTERPRET", None)  # conftest sets it; a user's shell does not
    return subprocess.run(
        [sys.executable, "-c", _RUN_MAIN, *argv], capture_output=True, text=True, env=env, timeout=120
    )
