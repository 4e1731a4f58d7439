#!/usr/bin/env bash
# Lint, format check, type check and the test suite: what CI runs after scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check src tests
"$PYTHON" -m ruff format --check src tests
"$PYTHON" -m mypy
"$PYTHON" -m pytest -q "$@"
