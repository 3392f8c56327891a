"""Segment pooling ops: one documented function each, dispatching to one of four implementations.

``impl`` selects the implementation (every one computes the same thing, defined in `spec`):

* ``"triton"`` (`triton_pool`): fused Triton kernels, float32 accumulation, registered as the
  ``torch.library`` ops ``dice_fast::pool_chunks_triton`` / ``dice_fast::aggregate_documents_triton``.
  CUDA, or the CPU under ``TRITON_INTERPRET=1`` (how CI tests them; slow).
* ``"native"`` (`native`): the C++ (CPU, vectorised, multi-threaded) and CUDA C++ twins in
  ``csrc/``, registered as ``dice_fast_C::*``; compiled on demand by `native.build()`.
* ``"torch"`` (`torch_pool`): vectorised PyTorch (``index_add_`` / ``scatter_reduce_`` / sorts,
  float32 accumulation, float64 per-chunk scalars), no Python loop over chunks or documents, no
  extra dependency; any device.
* ``"reference"`` (`spec`, alias ``"ref"``): the float64 reference that *defines* the semantics. It
  loops over documents in Python: the test oracle, not a production path.
* ``"auto"`` (default): ``triton`` on CUDA tensors (else ``native`` with CUDA kernels, else
  ``torch``); on the CPU ``native`` when the extension is loaded in this process, else ``torch``.

Each op's argument list is written once, as a schema string in `spec.SCHEMAS`; the functions below
pass their arguments through once to the implementation `resolve_impl` picks. Nothing here imports
Triton or builds the extension until a call needs it.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from .names import AGGREGATIONS, POOLINGS, SCHEMAS
from ..errors import OptionError

if TYPE_CHECKING:  # torch is imported by the calls, not here: the settings read IMPLS without it
    import torch

# concrete implementation -> module that defines `pool_chunks_<suffix>` and `aggregate_documents_<suffix>`
IMPLEMENTATIONS = {
    "triton": ("triton_pool", "triton"),
    "native": ("native", "native"),
    "torch": ("torch_pool", "torch"),
    "reference": ("spec", "ref"),
}
ALIASES = {"ref": "reference"}
IMPLS = ("auto", *IMPLEMENTATIONS, *ALIASES)

__all__ = [
    "AGGREGATIONS",
    "POOLINGS",
    "SCHEMAS",
    "IMPLS",
    "IMPLEMENTATIONS",
    "pool_chunks",
    "aggregate_documents",
    "segment_pool",
    "resolve_impl",
    "implementation",
]


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map ``impl`` (one of `IMPLS`) to the implementation (a key of `IMPLEMENTATIONS`) used for
    tensors on ``device``."""
    if impl not in IMPLS:
        raise OptionError(f"unknown pooling implementation {impl!r}; allowed: {', '.join(IMPLS)}")
    if impl != "auto":
        return ALIASES.get(impl, impl)
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        from . import native, triton_pool

        if triton_pool.available():
            return "triton"
        return "native" if native.has_cuda_kernels() else "torch"
    from . import native

    return "native" if native.is_loaded() and device.type == "cpu" else "torch"


_BUILD_FAILED: list[str] = []  # why `unavailable` could not build the C++ extension, once tried


def unavailable(impl: str, device: torch.device) -> str | None:
    """Why the concrete implementation ``impl`` cannot run on ``device`` in this process (None: it can),
    so that an encoder refuses an explicit choice when it is built, not at its first batch."""
    import torch

    device = torch.device(device)
    if impl == "triton":
        from . import triton_pool

        if not triton_pool.available() or (device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
            return ("the Triton kernels need triton and a CUDA device (on the CPU: TRITON_INTERPRET=1 set before "
                    "triton is imported)")
    if impl == "native":
        from . import native

        if not native.is_loaded():  # asked for by name (the command line cannot call build()): build it now
            if _BUILD_FAILED:  # once per process: a compiler that failed fails again
                return _BUILD_FAILED[0]
            try:
                native.build()
            except (RuntimeError, OSError) as exc:
                _BUILD_FAILED.append(f"the C++ extension did not build ({exc})")
                return _BUILD_FAILED[0]
        if device.type == "cuda" and not native.has_cuda_kernels():
            return "the C++ extension was built without CUDA kernels"
    return None


def implementation(op: str, impl: str):
    """The function computing ``op`` (a key of `SCHEMAS`) for the concrete implementation ``impl``."""
    module, suffix = IMPLEMENTATIONS[impl]
    return getattr(importlib.import_module(f"{__name__}.{module}"), f"{op}_{suffix}")


def pool_chunks(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str = "mean", impl: str = "auto") -> torch.Tensor:
    """Token states -> one float32 vector per chunk.

    hidden: (total_tokens, hidden_size) float32/bf16/fp16; cu_seqlens: (n_chunks + 1,) int32 on
    hidden's device. Returns (n_chunks, hidden_size) float32. ``pooling``: mean | cls | last.
    """
    op = implementation("pool_chunks", resolve_impl(impl, hidden.device))
    return op(hidden, cu_seqlens, pooling)


def aggregate_documents(
    chunks: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: torch.Tensor | None = None,
    aggregation: str = "mean",
    top_k: int = 1,
    temperature: float = 1.0,
    normalize_chunks: bool = False,
    normalize: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """Chunk vectors -> one float32 vector per document.

    chunks: (n_chunks, hidden_size) float32; cu_doc_chunks: (n_docs + 1,) int64; chunk_weights:
    (n_chunks,) float32 (needed by ``weighted_mean``). Returns (n_docs, hidden_size) float32.
    See `dice_fast.ops.spec` for the exact semantics of every mode.
    """
    op = implementation("aggregate_documents", resolve_impl(impl, chunks.device))
    return op(chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature, normalize_chunks, normalize)


def segment_pool(
    hidden: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: torch.Tensor | None = None,
    pooling: str = "mean",
    aggregation: str = "mean",
    top_k: int = 1,
    temperature: float = 1.0,
    normalize_chunks: bool = False,
    normalize: bool = True,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token states -> (chunk vectors (n_chunks, H), document vectors (n_docs, H)), float32.

    Reads ``hidden`` (total_tokens, H) once; the document step reads only the chunk vectors.
    """
    chunks = pool_chunks(hidden, cu_seqlens, pooling, impl=impl)
    docs = aggregate_documents(
        chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature, normalize_chunks, normalize, impl=impl
    )
    return chunks, docs
