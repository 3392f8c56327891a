#!/usr/bin/env bash
# The peers' own virtual environment for benchmarks/bench_peers.py: sentence-transformers with its
# ONNX Runtime and OpenVINO backends (optimum, optimum-intel, NNCF). Their pins (transformers,
# optimum's own range) may conflict with dice_fast's, so they live apart from it, outside the repo.
#
#   bash benchmarks/peers_env.sh            # creates $DICE_PEERS_VENV (default /work/peers-venv)
#   DICE_PEERS_VENV=/tmp/pv bash benchmarks/peers_env.sh
#
# The venv is isolated (a venv over the system's site-packages mixed the peers' huggingface-hub with
# our datasets and broke both); torch is pinned to the version already installed here, so pip takes
# the same CPU build (a bare `torch` requirement could pull a multi-GB CUDA build).
# Idempotent: re-running is cheap.
set -euo pipefail
VENV="${DICE_PEERS_VENV:-/work/peers-venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo 2.13.0)"
# torch pinned to the shared build so no requirement can replace it with a CUDA wheel; the rest pinned
# to the set that resolved on 2026-12-01 (unpinned, pip's resolver backtracked for over 20 minutes):
# optimum-onnx / optimum-intel need transformers < 5 and huggingface-hub < 1, which dice_fast cannot use
"$VENV/bin/python" -m pip install -q \
  "torch==${TORCH_VERSION}" "transformers==4.57.6" "huggingface-hub==0.36.2" \
  "sentence-transformers[onnx,openvino]==5.7.0" "optimum==2.1.0" "optimum-intel==1.27.0" "optimum-onnx==0.1.0" \
  "onnxruntime==1.32.0" "openvino==2026.4.1" "nncf==3.4.0" "datasets==4.8.5"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for p in ("torch", "transformers", "sentence-transformers", "optimum", "optimum-intel", "optimum-onnx",
          "onnxruntime", "openvino", "nncf"):
    try:
        print(f"{p}=={md.version(p)}")
    except md.PackageNotFoundError:
        print(f"{p}: not installed")
PY
echo "peers venv ready: $VENV"
