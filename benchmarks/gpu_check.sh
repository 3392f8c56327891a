#!/usr/bin/env bash
# Every GPU check and benchmark of dice_fast in one run (budget: ~6 minutes on one H200).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from the repo root
#   SMOKE=1 bash benchmarks/gpu_check.sh    # tiny sizes on the CPU: checks the script itself
#
# Needs torch, transformers, triton (no flash-attn, no network, no model download: the benchmark
# models are random-weight BERT-base and Qwen2-1.5B built from configs with a word-level tokenizer).
# Writes logs and CSVs under $OUT (default benchmarks/gpu_out) and prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-benchmarks/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
SMOKE="${SMOKE:-0}"
status=0

step() {  # step NAME TIMEOUT_S CMD... : run with a time limit, log to $OUT/NAME.log, record rc
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
  [ $rc -eq 0 ] || status=1
}

{ nvidia-smi 2>/dev/null || echo "no nvidia-smi"; date -u; git rev-parse HEAD 2>/dev/null
  $PY -c "import sys, torch, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)
try:
    import triton; print('triton', triton.__version__)
except Exception as e: print('triton missing', e)"; } >"$OUT/env.txt" 2>&1
: >"$OUT/steps.txt"

if [ "$SMOKE" = 1 ]; then
  step pooling 300 $PY benchmarks/bench_pooling.py --smoke --csv "$OUT/pooling.csv"
  step e2e_encoder 300 $PY -m dice_fast.cli bench --random-model bert-base --device cpu --dtypes float32 \
       --docs 8 --longest 1024 --repeats 1 --no-sentence-transformers --flops --csv "$OUT/e2e.csv"
else
  # 1. correctness on the GPU: engine backends vs the per-chunk oracle, Triton and CUDA C++ pooling
  step gpu_tests 150 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/ops -m gpu
  # 2. pooling kernel: GB/s vs copy bandwidth, vs PyTorch composites and the CUDA C++ twin
  step pooling 60 $PY benchmarks/bench_pooling.py --csv "$OUT/pooling.csv"
  # 3. end to end vs naive chunk batching, mixed corpus with a long tail to 32k tokens
  step e2e_encoder 80 $PY -m dice_fast.cli bench --random-model bert-base --dtypes bfloat16 --docs 1200 \
       --repeats 3 --no-sentence-transformers --flops --csv "$OUT/e2e.csv"
  step e2e_decoder 80 $PY -m dice_fast.cli bench --random-model qwen2-1.5b --chunk-size 512 --dtypes bfloat16 \
       --docs 300 --repeats 2 --no-sentence-transformers --flops --csv "$OUT/e2e.csv"
fi

echo
cat "$OUT/steps.txt"
for f in gpu_tests pooling e2e_encoder e2e_decoder; do
  [ -f "$OUT/$f.log" ] || continue
  echo "== $f (last lines)"
  grep -v -e '^Loading' -e 'it/s\]' "$OUT/$f.log" | tail -n 14
done
exit $status
