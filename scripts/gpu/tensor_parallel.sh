#!/usr/bin/env bash
# The two-GPU run (tensor parallelism), on a machine with the GPUs and this tree: the GPU tests of
# tensor parallelism, then `tokenmill bench tensor-parallel` (one report), then the server under TP=2.
# Logs and the report go to $OUT (default /tmp/tp-run). Wheels the host lacks (FastAPI, the openai
# client, ...) are installed from .whl/ first when it is there (../shared/device/wheels.sh fetches them).
#   STAGES="tests bench serve" SECTIONS=correctness,all-reduce,latency,throughput BENCH_ARGS="--iters 3" \
#       bash scripts/gpu/tensor_parallel.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tp-run}
STAGES=${STAGES:-"tests bench serve"}
SECTIONS=${SECTIONS:-correctness,all-reduce,latency,throughput}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src
else
    export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1

failed=0
stage() {  # name, timeout in seconds, command...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    [ $code = 0 ] || failed=1
    echo "== $name: exit $code in $((SECONDS - start)) s"
    tail -n 25 "$OUT/$name.log"
}

for name in $STAGES; do
    case $name in
        tests) stage tests "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -x -p no:cacheprovider \
                   -o faulthandler_timeout=120 tests/test_tensor_parallel_gpu.py ;;
        bench) stage bench "${BENCH_TIMEOUT:-420}" python3 -m tokenmill.cli bench tensor-parallel \
                   --sections "$SECTIONS" --report-dir "$OUT" ${BENCH_ARGS:-} ;;
        serve) stage serve "${SERVE_TIMEOUT:-240}" python3 -m pytest -q -x -p no:cacheprovider \
                   tests/test_serve_tensor_parallel.py -k cuda ;;
    esac
done
exit $failed
