#!/usr/bin/env bash
# The CPU throughput run behind benchmarks/RESULTS.md: engine vs naive chunk batching with the
# bundled all-MiniLM-L6-v2, fp32 and bf16, three corpora. About 30 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
$PY -m dice_fast.cli bench --corpus short --docs 400 --repeats 3 --csv benchmarks/results.csv
$PY -m dice_fast.cli bench --corpus mixed --docs 120 --repeats 3 --csv benchmarks/results.csv
$PY -m dice_fast.cli bench --corpus long --docs 10 --repeats 3 --csv benchmarks/results.csv
