#!/usr/bin/env bash
# Exploration for issue 18 on an H100/H200: whole-engine effect of the W8A8 GEMM's split input features
# (kernels/w8a8_gemm.py, narrow projections at <= 64 rows) on decode batches of dummy llama-3.1-8b:
# `bench throughput` with 32 requests of 128 prompt tokens and 256 outputs (every decode step 32 rows),
# split on (the default) and off (SPLIT_MAX_ROWS = 0 patched in), alternating, one process each.
#     OUT=dir PYTHONPATH=src bash scripts/experiments/w8a8_split_k_engine.sh [QUANTIZATIONS] [REQUESTS]
set -u
quants=${1:-fp8 int8}
requests=${2:-32}
for q in $quants; do
  for split in on off on off; do
    patch="import tokenmill.kernels.w8a8_gemm as g; g.SPLIT_MAX_ROWS = 64 if '$split' == 'on' else 0"
    timeout 170 python3 -c "$patch
import sys; from tokenmill.cli import main; sys.exit(main(sys.argv[1:]))" bench throughput \
      --model llama-3.1-8b --load-format dummy --dtype bfloat16 --quantization "$q" --skip-hf --no-progress \
      --num-requests "$requests" --input-len 128 --output-len 256 --report-dir "$OUT/$q-$split" \
      > "$OUT/log-$q-$split.txt" 2>&1
    echo "$q split $split: $(grep -E '^\| tokenmill' "$OUT/log-$q-$split.txt" | head -1)"
    [ "$q" = int8 ] && [ "$split" = off ] && break
  done
done
