#!/usr/bin/env bash
# Lint, format check, type check and the test suite: what CI runs after scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check src tests
"$PYTHON" -m ruff format --check src tests
"$PYTHON" -m mypy
# Two worker processes (TEST_WORKERS to change; 0 runs in this process); idle ones steal queued tests.
"$PYTHON" -m pytest -q -n "${TEST_WORKERS:-2}" --dist worksteal --durations=25 "$@"
