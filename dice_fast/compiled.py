"""The packed forward under ``torch.compile`` (inductor): fused elementwise work around the GEMMs.

`CompiledForward(model, takes_cache)` holds a *shadow* of the model — a copy of its module tree
that shares every parameter and buffer with it (no weight is copied) and whose config names the
traceable attention of `dice_fast.attention_op` — and that shadow's forward compiled once with
dynamic shapes: the token count, the number of chunks and the number of equal-length runs are
symbolic, so batches of any size reuse one graph (plus, at most, one for a batch of a single token:
the compiler specialises sizes 0 and 1). The caller's model is never modified.

    forward = CompiledForward(model, takes_cache=False)                      # backend="sdpa_groups"
    hidden = forward(input_ids, position_ids, cu_seqlens, groups, causal)   # (T, H)
    forward.compile_seconds                                                  # paid at the first call

On CUDA (``backend`` "flash_attn" or "torch_varlen") the attention is `dice_fast.attention_op.varlen`
and the fourth argument is the batch's ``max_len`` ((1,) int64 on the CPU) instead of the groups;
inductor's GPU backend compiles in `CUDA_MODE`, which is not measured yet (benchmarks/gpu_check.sh,
``modes`` step, measures eager vs compiled; "max-autotune-no-cudagraphs" is the other candidate).

Compilation happens at the first call (the runner makes it at construction, on its probe batch),
once per encoder and process; inductor's on-disk cache makes a later process's compile shorter.
On the CPU the linears run the eager forward's measured kernel (`dice_fast.cpu_linear`): where it is
oneDNN's, every ``F.linear`` is traced as the opaque op ``dice_fast::onednn_linear`` (inductor keeps
it as one call and fuses around it; its own lowering would take MKL's slow path on AMD: §16.10).
The model is frozen (``freezing``: weights are constants, GEMM weights pre-packed for oneDNN):
weights changed after the first call are not seen — build a new encoder after changing a model.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import threading
import time

import torch

from . import cpu_fusion, cpu_linear

CUDA_MODE = "default"  # torch.compile mode on CUDA: unmeasured (see the module docstring)
BACKEND = "inductor"  # the compiler (tests trace with "aot_eager": the same graph, no code generation)


def compile_options(device_type: str) -> dict:
    """torch.compile's ``options`` / ``mode`` for `BACKEND` on ``device_type``: inductor freezes the
    weights; on CUDA a `CUDA_MODE` other than "default" is passed alone (torch.compile takes a mode or
    options, not both), so it runs without freezing."""
    if BACKEND != "inductor":
        return {}
    if device_type == "cuda" and CUDA_MODE != "default":
        return {"mode": CUDA_MODE}
    return {"options": {"freezing": True}}


def compiler_missing(device_type: str) -> str | None:
    """None where the compiled forward can be built on ``device_type`` here, else why not: torch.compile
    turned off in this process (``TORCH_COMPILE_DISABLE=1``: every compiled function then runs eagerly,
    and a whole-graph compile fails listing hundreds of skipped frames), or on the CPU no C++ compiler
    for inductor (it builds the kernels with ``$CXX``, else g++; clang++ on macOS) on PATH."""
    if os.environ.get("TORCH_COMPILE_DISABLE") == "1":  # what torch reads (its documented switch)
        return "torch.compile is turned off in this process (TORCH_COMPILE_DISABLE=1 in the environment: unset it)"
    if BACKEND != "inductor" or device_type != "cpu":
        return None
    name = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    if shutil.which(name) is None:
        return (f"torch.compile builds its CPU kernels with a C++ compiler and finds none ({name!r} is not on "
                "PATH; CXX names another: install g++ or point CXX at a C++ compiler)")
    return None


class CompiledForward:
    """A compiled packed forward of one model (see the module docstring). backend: the attention
    ("sdpa_groups", or on CUDA "flash_attn" / "torch_varlen")."""

    def __init__(self, model, takes_cache: bool, backend: str = "sdpa_groups"):
        from . import attention_op

        attention_op.register()
        shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
        self.shadow = copy.deepcopy(model, memo=shared)  # new modules and config, the same tensors
        self.shadow.config._attn_implementation = attention_op.TRACED_NAME
        self.backend = backend
        # the eager forward's CPU linear kernel (dice_fast.cpu_linear), kept as an opaque op in the graph
        self.linear = cpu_linear.model_kernel(model)
        self._linear_op = cpu_linear.traced_linear() if self.linear == "onednn" else None
        self._gelu = cpu_fusion.active(cpu_fusion.gelu_pairs(model)) if self.linear == "onednn" else {}
        self._kwargs = {"use_cache": False} if takes_cache else {}
        if backend != "sdpa_groups":
            self._kwargs["dice_backend"] = backend
        self._fn = torch.compile(self._forward, dynamic=True, fullgraph=True, backend=BACKEND,
                                 **compile_options(next(model.parameters()).device.type))
        self._lock = threading.Lock()
        self.compile_seconds: float | None = None  # wall time of the first call (tracing + codegen + run)

    def _forward(self, input_ids, position_ids, cu, groups, causal):
        batch = {"dice_groups": groups} if self.backend == "sdpa_groups" else {"dice_max_len": groups}
        with cpu_linear.linear_mode(self.linear, self._linear_op, self._gelu):
            out = self.shadow(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
                              cu_seq_lens_q=cu, cu_seq_lens_k=cu, dice_causal=causal, **batch, **self._kwargs)
        return out.last_hidden_state[0]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                 groups: torch.Tensor, causal: bool | None) -> torch.Tensor:
        """input_ids, position_ids: (T,) int64; cu_seqlens: (n + 1,) int32; groups: (G, 3) int64 on the
        CPU (`dice_fast.attention_op.group_table`), or for the CUDA kernels max_len (1,) int64 on the CPU
        (`dice_fast.attention_op.max_len_tensor`). Returns the last hidden state (T, H)."""
        if self.compile_seconds is None:
            with self._lock:  # one thread compiles; the others wait for its graph
                if self.compile_seconds is None:
                    t0 = time.perf_counter()
                    out = self._fn(input_ids, position_ids, cu_seqlens, groups, causal)
                    self.compile_seconds = time.perf_counter() - t0
                    return out
        return self._fn(input_ids, position_ids, cu_seqlens, groups, causal)
