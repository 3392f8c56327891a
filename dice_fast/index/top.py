"""`DiceIndex`'s exact search: the top k documents per query, found block by block.

Blocks of documents are scored by one matrix product each and a running top k is kept (ties by
document order), so memory is bounded by the block (about ``BLOCK_SCORES`` query x chunk scores),
not the corpus.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

BLOCK_SCORES = 1 << 22  # query x chunk scores per exact-search block (16 MiB of float32)


def blocks(cu_doc_chunks: np.ndarray, n_q: int) -> Iterator[tuple[int, int]]:
    """Document ranges [d0, d1) of the documents whose chunks start at ``cu_doc_chunks`` (n_docs + 1,):
    about ``BLOCK_SCORES / n_q`` chunks and documents each (at least one document)."""
    budget = max(1, BLOCK_SCORES // max(n_q, 1))
    d0, n = 0, len(cu_doc_chunks) - 1
    while d0 < n:
        d1 = int(np.searchsorted(cu_doc_chunks, cu_doc_chunks[d0] + budget, side="right")) - 1
        d1 = min(max(d1, d0 + 1), d0 + budget, n)
        yield d0, d1
        d0 = d1


def exact_top(score_range: Callable, cu_doc_chunks: np.ndarray, q: np.ndarray, k: int, scoring: str,
              alpha: float) -> list[list[tuple[int, float]]]:
    """Per query of ``q`` (n_q, dim): its top ``k`` (document, score) pairs, best first (ties by
    document order). ``score_range(q, d0, d1, scoring, alpha)``: the (n_q, d1 - d0) scores of documents
    d0..d1-1."""
    n_q = len(q)
    best_s = np.full((n_q, 0), -np.inf, np.float64)
    best_d = np.zeros((n_q, 0), np.int64)  # columns stay in document order: a tie keeps the first
    for d0, d1 in blocks(cu_doc_chunks, n_q):
        s = score_range(q, d0, d1, scoring, alpha).astype(np.float64)
        s[np.isnan(s)] = -np.inf  # (only from overflowing vectors) ranks last
        s = np.concatenate([best_s, s], axis=1)
        d = np.concatenate([best_d, np.broadcast_to(np.arange(d0, d1), (n_q, d1 - d0))], axis=1)
        if s.shape[1] > k:
            keep = _top_mask(s, k)
            s, d = s[keep].reshape(n_q, k), d[keep].reshape(n_q, k)
        best_s, best_d = s, d
    return [by_score(best_d[i], best_s[i]) for i in range(n_q)]


def by_score(docs: np.ndarray, scores: np.ndarray) -> list[tuple[int, float]]:
    """(document, score) pairs by descending score, ties by document order."""
    order = np.lexsort((docs, -scores))
    return [(int(docs[i]), float(scores[i])) for i in order]


def _top_mask(s: np.ndarray, k: int) -> np.ndarray:
    """(n_q, m) bool: per row the k highest of ``s`` (n_q, m > k, no NaN), ties going to the first
    columns; linear in m (a partition, no sort)."""
    kth = np.partition(s, s.shape[1] - k, axis=1)[:, s.shape[1] - k : s.shape[1] - k + 1]
    above, tied = s > kth, s == kth
    room = k - above.sum(axis=1, keepdims=True)
    return above | (tied & (np.cumsum(tied, axis=1) <= room))
