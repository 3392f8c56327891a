#!/usr/bin/env bash
# The CPU evaluation behind benchmarks/eval/SUMMARY.md (bundled all-MiniLM-L6-v2, float32).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
DTYPE=${DTYPE:-float32}
$PY -m dice_fast.cli eval --task passkey needle \
    --lengths 256,512,1024,2048,4096,8192,16384,32768 \
    --docs-per-length 20 --queries-per-length 10 --seed 0 \
    --chunk-sizes 64,254 --aggregations mean,max,topk_norm,weighted_mean,softmax_norm \
    --dtype "$DTYPE" --out-dir benchmarks/eval
