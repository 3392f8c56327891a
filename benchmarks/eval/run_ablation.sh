#!/usr/bin/env bash
# The normalize_chunks ablation, MaxSim / hybrid rows and evidence@1 behind benchmarks/RESULTS.md §5
# (bundled all-MiniLM-L6-v2, float32, CPU). Every (task, length, chunk size) is encoded once into
# $CACHE (raw chunk vectors, each distinct chunk run once); everything else is derived from them, so
# a rerun with other options re-encodes nothing. Test split: seed 0; dev split (hybrid alpha): seed 1.
#   NEEDLE_LENGTHS=...  lengths of the needle test run (default: what fitted the shared 2-core CPU)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
CACHE=${CACHE:-/tmp/dice-eval-cache}
OUT=benchmarks/eval/ablation
ALL=256,512,1024,2048,4096,8192,16384,32768
NEEDLE_LENGTHS=${NEEDLE_LENGTHS:-256,512,1024,2048,4096}
common=(--docs-per-length 50 --queries-per-length 50 --chunk-sizes 64,128,254 --dtype float32
        --normalize-chunks-ablation --cache-dir "$CACHE" --save-result --quiet)
# reported (test) runs: every aggregation, both normalize_chunks settings, MaxSim, hybrid (default alpha)
nice -n 19 $PY -m dice_fast.cli eval --task passkey --lengths $ALL --seed 0 "${common[@]}" \
    --out-dir $OUT --csv benchmarks/eval/ablation.csv --tag test
nice -n 19 $PY -m dice_fast.cli eval --task needle --lengths "$NEEDLE_LENGTHS" --seed 0 "${common[@]}" \
    --out-dir $OUT --csv benchmarks/eval/ablation.csv --tag test
# dev runs (another seed): the hybrid's alpha grid
nice -n 19 $PY -m dice_fast.cli eval --task passkey --lengths $ALL --seed 1 "${common[@]}" --aggregations mean \
    --hybrid-alphas 0,0.25,0.5,0.75,1 --no-plots --check-docs 0 --out-dir $OUT/dev --csv $OUT/dev/dev.csv --tag dev
nice -n 19 $PY -m dice_fast.cli eval --task needle --lengths 256,512,1024 --seed 1 "${common[@]}" --aggregations mean \
    --hybrid-alphas 0,0.25,0.5,0.75,1 --no-plots --check-docs 0 --out-dir $OUT/dev --csv $OUT/dev/dev.csv --tag dev
# the summary tables: normalize_chunks on/off, the alpha choice, dice / maxsim / hybrid by length
$PY -m dice_fast.eval.ablation --test $OUT/passkey-float32-test.pkl $OUT/needle-float32-test.pkl \
    --dev $OUT/dev/passkey-float32-dev.pkl $OUT/dev/needle-float32-dev.pkl > $OUT/SUMMARY.md
