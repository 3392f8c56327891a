"""Segment pooling ops: one documented function each, dispatching to the fastest implementation.

``impl`` selects the implementation:

* ``"auto"`` (default): Triton on CUDA tensors, the C++ extension on CPU tensors when it has been
  built (`dice_fast.ops.native.build()`), else the PyTorch reference;
* ``"ref"``: the float64 reference in `dice_fast.ops.spec` (the spec);
* ``"triton"``: the Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``);
* ``"native"``: the C++/CUDA extension from ``csrc/`` (raises if it is not built).

Nothing here imports Triton or builds the extension until a call needs it.
"""

from __future__ import annotations

import torch

from .spec import (
    AGGREGATIONS,
    POOLINGS,
    aggregate_documents_ref,
    pool_chunks_ref,
)

IMPLS = ("auto", "ref", "triton", "native")

__all__ = [
    "AGGREGATIONS",
    "POOLINGS",
    "IMPLS",
    "pool_chunks",
    "aggregate_documents",
    "segment_pool",
    "resolve_impl",
]


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map ``impl`` (one of `IMPLS`) to the concrete implementation used for tensors on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"unknown pooling implementation {impl!r}; allowed: {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    if device.type == "cuda":
        from . import triton_pool

        return "triton" if triton_pool.available() else "ref"
    from . import native

    return "native" if native.is_loaded() else "ref"


def pool_chunks(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str = "mean", impl: str = "auto") -> torch.Tensor:
    """Token states -> one float32 vector per chunk.

    hidden: (total_tokens, hidden_size) float32/bf16/fp16; cu_seqlens: (n_chunks + 1,) int32 on
    hidden's device. Returns (n_chunks, hidden_size) float32. ``pooling``: mean | cls | last.
    """
    which = resolve_impl(impl, hidden.device)
    if which == "triton":
        from .triton_pool import pool_chunks_triton

        return pool_chunks_triton(hidden, cu_seqlens, pooling)
    if which == "native":
        from .native import pool_chunks_native

        return pool_chunks_native(hidden, cu_seqlens, pooling)
    return pool_chunks_ref(hidden, cu_seqlens, pooling)


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
    which = resolve_impl(impl, chunks.device)
    args = (chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature, normalize_chunks, normalize)
    if which == "triton":
        from .triton_pool import aggregate_documents_triton

        return aggregate_documents_triton(*args)
    if which == "native":
        from .native import aggregate_documents_native

        return aggregate_documents_native(*args)
    return aggregate_documents_ref(*args)


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
