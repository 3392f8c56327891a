"""Scoring documents against queries from DICE vectors: one definition shared by `dice_fast.index`
and `dice_fast.eval` (pure numpy, no model).

Every scoring works on one block of documents at a time and returns, per (query, document), a
``score`` and the ``evidence`` chunk: the index, within its document, of the chunk that scores
highest for the query (the passage to read).

* ``dice``: the document vector ranks: ``score = queries @ documents.T``.
* ``maxsim``: a document scores its best chunk (multi-vector): ``score = max_c queries @ chunks[c]``.
* ``hybrid``: ``alpha * dice + (1 - alpha) * maxsim`` (``alpha`` = `DEFAULT_ALPHA` unless given).

Layout of a block of documents (as `DiceOutput` gives it): ``chunks`` (n_chunks, dim) with each
document's chunks contiguous, and ``cu_doc_chunks`` (n_docs + 1,) int64 so document ``d`` owns rows
``cu_doc_chunks[d]:cu_doc_chunks[d+1]``. A document without chunks scores ``-inf`` under maxsim
(and its evidence is -1). Vectors are used as given (L2-normalised vectors make these cosines);
products are taken in float32 unless the inputs are float64.
"""

from __future__ import annotations

import numpy as np
from .errors import OptionError

SCORINGS = ("dice", "maxsim", "hybrid")
# measured (benchmarks/RESULTS.md §5.1): MaxSim beats every single-vector scoring at every length (needle
# 16k-32k: document vectors at chance, MaxSim 46-58 %); the default of every store, retriever and `search`
DEFAULT_SCORING = "maxsim"
# measured (benchmarks/RESULTS.md §5.4, dev split): mean Hit@1 over passkey/needle x chunk sizes
DEFAULT_ALPHA = 0.0  # 69.5 at 0, 68.7 at 0.25, 68.5 at 0.5, 65.7 at 0.75, 44.2 at 1 (all-MiniLM-L6-v2)


def check_scoring(scoring: str) -> str:
    """Return ``scoring``; ValueError naming the allowed ones otherwise."""
    if scoring not in SCORINGS:
        raise OptionError(f"unknown scoring {scoring!r}; allowed: {', '.join(map(repr, SCORINGS))}")
    return scoring


def cu_from_chunk_document(chunk_document: np.ndarray, n_docs: int) -> np.ndarray:
    """(n_docs + 1,) int64 chunk offsets from a sorted (n_chunks,) document index per chunk."""
    cu = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(np.bincount(np.asarray(chunk_document, np.int64), minlength=n_docs), out=cu[1:])
    return cu


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """(n, dim) float32 rows scaled to unit L2 norm (norms clamped at the engine's ``NORM_EPS``, so
    zero rows stay zero). The evaluation, the index and the evidence route score chunks as cosines
    this way whatever the encoder's ``normalize_chunks``: raw pooled norms carry no relevance
    (benchmarks/RESULTS.md §5.3)."""
    from .ops.spec import NORM_EPS

    x = np.asarray(vectors, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), NORM_EPS)


def finite_rows(rows: np.ndarray) -> np.ndarray:
    """(n,) bool: which rows of (n, dim) ``rows`` hold neither NaN nor an infinity (a float64 row sum:
    no overflow, no mask of the array's size)."""
    return np.isfinite(np.asarray(rows).sum(axis=1, dtype=np.float64))


def first_non_finite(rows: np.ndarray) -> int | None:
    """The first row of (n, dim) ``rows`` holding NaN or an infinity, or None."""
    finite = finite_rows(rows)
    return None if finite.all() else int(np.argmin(finite))


def chunk_scores(queries: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """(n_queries, dim) x (n_chunks, dim) -> (n_queries, n_chunks) inner products."""
    q, c = _common(queries, chunks)
    return q @ c.T


def best_chunks(scores: np.ndarray, cu_doc_chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per (query, document) best chunk of ``scores`` (n_queries, n_chunks) under ``cu_doc_chunks``.

    Returns (best, index): (n_queries, n_docs) its score (``-inf`` for a document without chunks, NaN
    where every chunk's is NaN; NaN scores are skipped) and (n_queries, n_docs) int64 its index within
    the document (-1 without chunks or without a number among their scores).
    """
    cu = np.asarray(cu_doc_chunks, np.int64)
    n_q, n_docs = scores.shape[0], len(cu) - 1
    counts = np.diff(cu)
    best = best_chunk_scores(scores, cu)
    index = np.full((n_q, n_docs), -1, dtype=np.int64)
    has = np.flatnonzero(counts > 0)
    if len(has) == 0 or n_q == 0:
        return best, index
    starts = cu[has]
    # the argmax inside each document: the first chunk reaching the document's maximum
    doc_of_chunk = np.repeat(np.arange(n_docs), counts)
    hit = scores >= best[:, doc_of_chunk]
    position = np.where(hit, np.arange(scores.shape[1]) - cu[doc_of_chunk], np.iinfo(np.int64).max)
    index[:, has] = np.minimum.reduceat(position, starts, axis=1)
    index[index == np.iinfo(np.int64).max] = -1  # every chunk's score NaN (a non-finite chunk vector)
    return best, index


def best_chunk_scores(scores: np.ndarray, cu_doc_chunks: np.ndarray) -> np.ndarray:
    """The ``best`` of `best_chunks` alone, without the argmax (what a ranking needs): (n_queries,
    n_docs) each document's best chunk score, ``-inf`` without chunks, NaN scores skipped."""
    cu = np.asarray(cu_doc_chunks, np.int64)
    best = np.full((scores.shape[0], len(cu) - 1), -np.inf,
                   dtype=scores.dtype if scores.dtype.kind == "f" else np.float64)
    has = np.flatnonzero(np.diff(cu) > 0)
    if len(has) and scores.shape[0]:
        best[:, has] = np.fmax.reduceat(scores, cu[has], axis=1)  # empty documents own no columns; NaN is skipped
    return best


def dice(queries: np.ndarray, documents: np.ndarray, chunks: np.ndarray | None = None,
         cu_doc_chunks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Document-vector scoring. queries (n_queries, dim), documents (n_docs, dim), optional chunks
    (n_chunks, dim) with cu_doc_chunks (n_docs + 1,).

    Returns (score, evidence): (n_queries, n_docs) ``queries @ documents.T`` and (n_queries, n_docs)
    int64 each document's best chunk for the query (None without chunks).
    """
    q, d = _common(queries, documents)
    score = q @ d.T
    if chunks is None:
        return score, None
    _, evidence = best_chunks(chunk_scores(queries, chunks), cu_doc_chunks)
    return score, evidence


def maxsim(queries: np.ndarray, chunks: np.ndarray, cu_doc_chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Multi-vector scoring: a document scores its best chunk. queries (n_queries, dim), chunks
    (n_chunks, dim), cu_doc_chunks (n_docs + 1,).

    Returns (score, evidence): (n_queries, n_docs) the best chunk's score (``-inf`` for a document
    without chunks) and (n_queries, n_docs) int64 that chunk's index within its document.
    """
    return best_chunks(chunk_scores(queries, chunks), cu_doc_chunks)


def hybrid(queries: np.ndarray, documents: np.ndarray, chunks: np.ndarray, cu_doc_chunks: np.ndarray,
           alpha: float = DEFAULT_ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """Blend: ``alpha * dice + (1 - alpha) * maxsim`` with 0 <= alpha <= 1. Shapes as `dice`.

    Returns (score, evidence): (n_queries, n_docs) and (n_queries, n_docs) int64 the best chunk.
    """
    alpha = check_alpha(alpha)
    doc_score, _ = dice(queries, documents)
    chunk_best, evidence = maxsim(queries, chunks, cu_doc_chunks)
    return blend(alpha, doc_score, chunk_best), evidence


def blend(alpha: float, dice_score, maxsim_score):
    """``alpha * dice_score + (1 - alpha) * maxsim_score`` in the scores' float dtype; a zero weight
    contributes nothing (at alpha = 1 a document without chunks, maxsim ``-inf``, scores its dice
    score, not ``0 * -inf`` = NaN)."""
    if alpha == 1.0:
        return dice_score
    if alpha == 0.0:
        return maxsim_score
    real = np.result_type(dice_score, maxsim_score).type
    return real(alpha) * dice_score + real(1 - alpha) * maxsim_score


def score(scoring: str, queries: np.ndarray, documents: np.ndarray, chunks: np.ndarray | None,
          cu_doc_chunks: np.ndarray | None, alpha: float = DEFAULT_ALPHA) -> tuple[np.ndarray, np.ndarray | None]:
    """Dispatch to `dice`, `maxsim` or `hybrid` by name; same (score, evidence) as they return."""
    check_scoring(scoring)
    if scoring == "dice":
        return dice(queries, documents, chunks, cu_doc_chunks)
    if chunks is None:
        raise OptionError(f"scoring {scoring!r} needs chunk vectors")
    if scoring == "maxsim":
        return maxsim(queries, chunks, cu_doc_chunks)
    return hybrid(queries, documents, chunks, cu_doc_chunks, alpha)


def score_only(scoring: str, queries: np.ndarray, documents: np.ndarray, chunks: np.ndarray | None,
               cu_doc_chunks: np.ndarray | None, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
    """The ``score`` of `score` (the same numbers), without finding the evidence chunk: a ranking over
    many documents needs evidence only for its hits, and the argmax costs more than the product."""
    check_scoring(scoring)
    if scoring == "dice":
        return dice(queries, documents)[0]
    if chunks is None:
        raise OptionError(f"scoring {scoring!r} needs chunk vectors")
    best = best_chunk_scores(chunk_scores(queries, chunks), cu_doc_chunks)
    return best if scoring == "maxsim" else blend(check_alpha(alpha), dice(queries, documents)[0], best)


def check_alpha(alpha) -> float:
    """``alpha`` as a float in [0, 1]; `OptionError` naming it otherwise (None, a string, NaN ...)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(alpha) <= 1.0:
        raise OptionError(f"alpha must be a number between 0 and 1, got {alpha!r}")
    return float(alpha)


def _common(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both as 2-d arrays of one float dtype (float64 if either is, else float32), same width."""
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != 2 or b.ndim != 2:
        raise OptionError(f"expected 2-d arrays, got shapes {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[1]:
        raise OptionError(f"vector widths differ: {a.shape[1]} and {b.shape[1]}")
    dtype = np.float64 if np.float64 in (a.dtype, b.dtype) else np.float32
    return a.astype(dtype, copy=False), b.astype(dtype, copy=False)
