#!/usr/bin/env bash
# Late chunking beside DICE (issue 27): single, DICE (mean, max, MaxSim) and late chunking (mean, max,
# MaxSim) at chunk sizes 64 / 128 / 254 on passkey, needle and the boundary task; bundled MiniLM, float32.
# Sized for ~10 min on a shared 2-core CPU; the full sizes (needle to 32k, 50 docs per length) are the
# same commands with --lengths 256,512,1024,2048,4096,8192,16384,32768 --docs-per-length 50.
set -euo pipefail
OUT=${OUT:-benchmarks/eval/late}
COMMON="--chunk-sizes 64,128,254 --aggregations mean,max --scorings maxsim --strategies dice,late --check-docs 1 --no-plots -q --out-dir $OUT"
dice-fast eval --task boundary --docs-per-length 40 $COMMON
dice-fast eval --task passkey --lengths 256,512,1024,2048,4096,8192,16384,32768 --docs-per-length 6 --queries-per-length 6 $COMMON
dice-fast eval --task needle --lengths 256,1024,4096 --docs-per-length 6 --queries-per-length 6 $COMMON
