"""scripts/install.sh says what it is doing: each step with the time so far, pip's own progress, and the
total at the end; and the tokenmill it installs runs."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_install_shows_its_steps_and_installs_a_working_tokenmill(tmp_path: Path) -> None:
    """Into a new virtualenv that sees this machine's packages (so nothing large is downloaded)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {**os.environ, "PYTHON": str(python)}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "install.sh")], capture_output=True, text=True, env=env, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    steps = re.findall(r"^==> \[(\d)/4\] .+ \((\d+)s\)$", result.stdout, re.M)
    assert [int(number) for number, _ in steps] == [1, 2, 3, 4]
    assert [int(seconds) for _, seconds in steps] == sorted(int(seconds) for _, seconds in steps)
    assert re.search(r"^==> done in \d+ s", result.stdout, re.M)
    assert "Requirement already satisfied" in result.stdout or "Collecting" in result.stdout  # pip speaks
    help_text = subprocess.run(
        [str(venv / "bin" / "tokenmill"), "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert help_text.returncode == 0 and help_text.stdout.startswith("usage: tokenmill")
