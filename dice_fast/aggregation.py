"""The aggregation stage: a plan's pooled chunk vectors -> its document vectors (and, when asked, the
chunk vectors returned to the caller).

    documents, chunks = aggregate(vectors, plan, "mean", settings, keep_chunks=True)

Tokens became chunk vectors in the runner (token pooling); here chunks become documents: the kernel
of `dice_fast.ops.aggregate_documents` over each document's chunks (chunk normalisation, the
aggregation, document normalisation), then Matryoshka truncation to ``truncate_dim``
(`dice_fast.matryoshka`), which applies after aggregating the full-width vectors.
"""

from __future__ import annotations

import numpy as np
import torch

from .chunking import EncodingPlan
from .matryoshka import truncate
from .ops import aggregate_documents
from .scoring import first_non_finite
from .settings import Settings


def aggregate(vectors: torch.Tensor, plan: EncodingPlan, aggregation: str, settings: Settings,
              keep_chunks: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """vectors: (plan.n_chunks, hidden) float32, the pooled chunk vectors of ``plan`` in its chunk order.

    Returns (documents (plan.n_docs, dim) float32, chunks (plan.n_chunks, dim) float32 or None): the
    documents aggregated by ``aggregation`` with the options of ``settings``; the chunks (only when
    ``keep_chunks``) L2-normalised when ``settings.normalize_chunks``, both truncated to
    ``settings.dim``."""
    c = settings.config
    cu = torch.from_numpy(plan.chunks.cu_doc_chunks).to(vectors.device)
    weights = torch.from_numpy(plan.chunk_weights).to(vectors.device) if aggregation == "weighted_mean" else None
    docs = aggregate_documents(vectors, cu, weights, aggregation, c.top_k, c.temperature,
                               settings.normalize_chunks, c.normalize, impl=settings.pooling_impl)
    docs = truncate(docs, c.truncate_dim, c.normalize)  # Matryoshka: after aggregating full vectors
    # a chunk whose norm overflows float32 (values past ~1e18) normalises to zeros, silently: its
    # document is marked not finite instead, and `non_finite_document` names it
    finite = torch.isfinite(torch.linalg.vector_norm(vectors, dim=1))
    if len(vectors) and not bool(finite.all()):
        docs[torch.from_numpy(plan.chunks.document).to(vectors.device)[~finite]] = float("nan")
    chunks = None
    if keep_chunks:
        out = torch.nn.functional.normalize(vectors, dim=1, eps=1e-12) if settings.normalize_chunks else vectors
        out = truncate(out, c.truncate_dim, settings.normalize_chunks)
        # the caller's own rows: ``vectors`` may be a batch's output, which the chunk stores hold
        chunks = (out.clone() if out is vectors else out).cpu().numpy()
    return docs.cpu().numpy(), chunks


def non_finite_document(plan: EncodingPlan, documents: np.ndarray, chunks: np.ndarray | None) -> int | None:
    """The first document of ``plan`` (its index in the plan) whose vector in ``documents``, or chunk
    vector in ``chunks`` (when kept), holds NaN or an infinity; None when every one is finite. What
    `aggregate` returned is checked here before it leaves the engine (`NonFiniteOutput`)."""
    bad = [first_non_finite(documents)]
    if chunks is not None and (c := first_non_finite(chunks)) is not None:
        bad.append(int(plan.chunks.document[c]))
    return min((b for b in bad if b is not None), default=None)


__all__ = ["aggregate", "non_finite_document"]
