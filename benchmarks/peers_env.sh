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
# torch pinned to the shared build so no requirement can replace it with a CUDA wheel
"$VENV/bin/python" -m pip install -q \
  "torch==${TORCH_VERSION}" \
  "sentence-transformers[onnx,openvino]" optimum optimum-intel nncf onnxruntime openvino datasets
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
