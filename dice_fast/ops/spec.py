"""Segment pooling: token states -> chunk vectors -> document vectors.

This module is the *specification* of the pooling op. It holds

* `SCHEMAS`: the argument list of each op, written once as a ``torch.library`` schema string. The
  Triton ops are declared from these strings (`dice_fast.ops.triton_pool`), the C++ library
  defines the same ones (``csrc/register.cpp``), and every Python implementation spells the same
  names and defaults: ``tests/ops/test_dispatch.py`` checks all three;
* the input validation shared by every implementation (`check_pool_chunks_inputs`,
  `check_aggregate_inputs`), so every implementation (Triton, C++, vectorised PyTorch, the
  reference) rejects the same inputs with the same messages;
* the pure-PyTorch references `pool_chunks_ref` and `aggregate_documents_ref` (impl
  ``"reference"``), computed in float64, which define the semantics every fast path is tested
  against. They are the test oracle, not a production path: the aggregation loops over documents
  in Python.

The public entry points `pool_chunks`, `aggregate_documents` and `segment_pool` live in
`dice_fast.ops` and pick the fastest available implementation for the input's device.

Layout conventions (all implementations):

* ``hidden``: (total_tokens, hidden_size), float32 / bfloat16 / float16, row-contiguous.
* ``cu_seqlens``: (n_chunks + 1,) int32, ``cu_seqlens[0] == 0``, non-decreasing; chunk ``c``
  owns rows ``cu_seqlens[c]:cu_seqlens[c+1]`` and has at least one token.
* ``cu_doc_chunks``: (n_docs + 1,) int64, ``cu_doc_chunks[0] == 0``, non-decreasing; document
  ``d`` owns chunks ``cu_doc_chunks[d]:cu_doc_chunks[d+1]`` (chunks of a document are contiguous
  and every document has at least one chunk).
* ``chunk_weights``: (n_chunks,) float32, the weight of each chunk for ``weighted_mean``
  (the engine passes the number of tokens the chunk was pooled over).

Modes:

* token -> chunk (``pooling``): ``mean`` over all of the chunk's tokens, ``cls`` = its first
  token, ``last`` = its last token.
* chunk -> document (``aggregation``): ``mean``; ``weighted_mean`` by ``chunk_weights``; ``max``
  element-wise; ``topk_norm`` = mean of the ``top_k`` chunks of largest L2 norm (all chunks when
  the document has fewer; ties go to the earlier chunk); ``softmax_norm`` = weighted mean with
  weights ``softmax(norm / temperature)`` over the document's chunks.
* ``normalize_chunks`` L2-normalises chunk vectors *before* aggregation. ``topk_norm`` and
  ``softmax_norm`` always rank / weight chunks by the norm of the chunk vector as pooled (before
  this normalisation): the norm is the salience signal, and the norms of normalised vectors are all
  1 up to rounding, which would make the choice depend on rounding noise.
  ``normalize`` L2-normalises the document vectors. L2 normalisation divides by
  ``max(norm, 1e-12)`` like ``torch.nn.functional.normalize``.
"""

from __future__ import annotations

import torch

from ..errors import OptionError
from .names import (  # noqa: F401  (re-exported: spec is where the semantics are read)
    AGGREGATIONS, MIN_TEMPERATURE, NORM_EPS, POOLINGS, SCHEMAS, check_aggregation, check_pooling,
)

HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# validation shared by every implementation
# --------------------------------------------------------------------------------------------
def check_pool_chunks_inputs(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str) -> int:
    """Validate `pool_chunks` arguments (shapes, dtypes, devices); return the pooling code.

    Only metadata is inspected (no device synchronisation): the values of ``cu_seqlens`` are the
    caller's contract (see the module docstring).
    """
    code = check_pooling(pooling)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise OptionError(f"hidden must be a 2-D tensor (total_tokens, hidden_size), got {_describe(hidden)}")
    if hidden.dtype not in HIDDEN_DTYPES:
        raise OptionError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    _check_offsets(cu_seqlens, "cu_seqlens", "(n_chunks + 1,)", torch.int32, hidden, "hidden")
    return code


def check_aggregate_inputs(
    chunks: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: torch.Tensor | None,
    aggregation: str,
    top_k: int,
    temperature: float,
) -> int:
    """Validate `aggregate_documents` arguments; return the aggregation code."""
    code = check_aggregation(aggregation, top_k, temperature)
    if not isinstance(chunks, torch.Tensor) or chunks.dim() != 2:
        raise OptionError(f"chunks must be a 2-D tensor (n_chunks, hidden_size), got {_describe(chunks)}")
    if chunks.dtype != torch.float32:
        raise OptionError(f"chunks must be float32, got {chunks.dtype}")
    _check_offsets(cu_doc_chunks, "cu_doc_chunks", "(n_docs + 1,)", torch.int64, chunks, "chunks")
    if aggregation == "weighted_mean":
        if chunk_weights is None:
            raise OptionError("aggregation='weighted_mean' needs chunk_weights (n_chunks,) float32")
        if chunk_weights.shape != (chunks.shape[0],) or chunk_weights.dtype != torch.float32:
            raise OptionError(
                f"chunk_weights must be float32 of shape ({chunks.shape[0]},), got {_describe(chunk_weights)}"
            )
        if chunk_weights.device != chunks.device:
            raise OptionError(f"chunk_weights is on {chunk_weights.device} but chunks is on {chunks.device}")
    return code


def _check_offsets(offsets, name: str, shape: str, dtype: torch.dtype, data: torch.Tensor, data_name: str) -> None:
    """A cumulative-offsets argument: a non-empty 1-D tensor of ``dtype`` on ``data``'s device."""
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1:
        raise OptionError(f"{name} must be a 1-D tensor {shape}, got {_describe(offsets)}")
    if offsets.dtype != dtype:
        raise OptionError(f"{name} must be {str(dtype).replace('torch.', '')}, got {offsets.dtype}")
    if offsets.device != data.device:
        raise OptionError(f"{name} is on {offsets.device} but {data_name} is on {data.device}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


# --------------------------------------------------------------------------------------------
# references (the spec): float64 internally, float32 out
# --------------------------------------------------------------------------------------------
def pool_chunks_ref(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """Token states -> one vector per chunk.

    hidden: (total_tokens, hidden_size); cu_seqlens: (n_chunks + 1,) int32.
    Returns (n_chunks, hidden_size) float32.
    """
    check_pool_chunks_inputs(hidden, cu_seqlens, pooling)
    h = hidden.to(torch.float64)
    cu = cu_seqlens.to(torch.int64)
    starts, ends = cu[:-1], cu[1:]
    n = starts.numel()
    if n == 0:
        return hidden.new_zeros((0, hidden.shape[1]), dtype=torch.float32)
    if pooling == "cls":
        return h[starts].to(torch.float32)
    if pooling == "last":
        return h[ends - 1].to(torch.float32)
    lengths = ends - starts
    seg = torch.repeat_interleave(torch.arange(n, device=h.device), lengths)
    out = torch.zeros((n, h.shape[1]), dtype=torch.float64, device=h.device)
    out.index_add_(0, seg, h[: int(cu[-1])])
    return (out / lengths.clamp_min(1).unsqueeze(1).to(torch.float64)).to(torch.float32)


def aggregate_documents_ref(
    chunks: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: torch.Tensor | None = None,
    aggregation: str = "mean",
    top_k: int = 1,
    temperature: float = 1.0,
    normalize_chunks: bool = False,
    normalize: bool = True,
) -> torch.Tensor:
    """Chunk vectors -> one vector per document.

    chunks: (n_chunks, hidden_size) float32; cu_doc_chunks: (n_docs + 1,) int64;
    chunk_weights: (n_chunks,) float32 or None. Returns (n_docs, hidden_size) float32.
    """
    check_aggregate_inputs(chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature)
    c = chunks.to(torch.float64)
    all_norms = c.norm(dim=1)  # salience: norms as pooled, before normalize_chunks
    if normalize_chunks:
        c = c / all_norms.unsqueeze(1).clamp_min(NORM_EPS)
    bounds = cu_doc_chunks.tolist()
    rows = []
    for d in range(len(bounds) - 1):
        x = c[bounds[d] : bounds[d + 1]]
        if x.shape[0] == 0:
            rows.append(c.new_zeros(c.shape[1]))
            continue
        if aggregation == "mean":
            v = x.mean(0)
        elif aggregation == "weighted_mean":
            w = chunk_weights[bounds[d] : bounds[d + 1]].to(torch.float64)
            v = (w.unsqueeze(1) * x).sum(0) / w.sum().clamp_min(NORM_EPS)
        elif aggregation == "max":
            v = x.max(0).values
        elif aggregation == "topk_norm":
            norms = all_norms[bounds[d] : bounds[d + 1]]
            # stable descending sort: equal norms keep chunk order, so ties go to the earlier chunk
            order = torch.sort(norms, descending=True, stable=True).indices[: min(top_k, x.shape[0])]
            v = x[order].mean(0)
        else:  # softmax_norm
            w = torch.softmax(all_norms[bounds[d] : bounds[d + 1]] / float(temperature), dim=0)
            v = (w.unsqueeze(1) * x).sum(0)
        rows.append(v)
    out = torch.stack(rows) if rows else c.new_zeros((0, c.shape[1]))
    if normalize:
        out = out / out.norm(dim=1, keepdim=True).clamp_min(NORM_EPS)
    return out.to(torch.float32)
