"""Exact scores of the (query, document) pairs an approximate search proposes, all pairs at once.

Each pair's score equals, bit for bit, the score of the document scored alone for the query alone
(`DiceIndex._score_range(q[i : i + 1], d, d + 1)`, one call per pair before): a BLAS product's
rounding can depend on the shape multiplied, so the pairs are grouped by their document's chunk count
``m`` and each group is one stacked product of the shape a lone document gives, (1, dim) x (dim, m),
reduced per document as `dice_fast.scoring.best_chunk_scores` reduces one document.
"""

from __future__ import annotations

import numpy as np

from .. import scoring as sc

_BLOCK_VALUES = 1 << 22  # gathered chunk values per stacked product (16 MiB of float32)


def pair_scores(q: np.ndarray, documents: np.ndarray, chunks: np.ndarray, cu: np.ndarray, pair_q: np.ndarray,
                pair_d: np.ndarray, scoring: str, alpha: float) -> np.ndarray:
    """(n_pairs,) the ``scoring`` score of document ``pair_d[j]`` (its vector ``documents[d]``, its
    chunks ``chunks[cu[d]:cu[d + 1]]``) for the query ``q[pair_q[j]]``; ``-inf`` for maxsim without chunks."""
    dtype = np.float64 if q.dtype == np.float64 else np.float32
    if scoring != "maxsim":
        dice = np.empty(len(pair_d), dtype)
        for g in _slices(np.arange(len(pair_d)), _BLOCK_VALUES // q.shape[1]):
            dice[g] = _stacked(q, pair_q[g], documents, pair_d[g, None], dtype)[:, 0]
        if scoring == "dice":
            return dice
    counts = cu[pair_d + 1] - cu[pair_d]
    best = np.full(len(pair_d), -np.inf, dtype)
    order = np.argsort(counts, kind="stable")
    for group in np.split(order, np.flatnonzero(np.diff(counts[order])) + 1):
        m = int(counts[group[0]]) if len(group) else 0
        if m == 0:
            continue  # no chunks: -inf, as `best_chunk_scores` gives
        for g in _slices(group, _BLOCK_VALUES // (m * chunks.shape[1])):
            s = _stacked(q, pair_q[g], chunks, cu[pair_d[g], None] + np.arange(m), dtype)
            best[g] = np.fmax.reduceat(s, [0], axis=1)[:, 0]
    return best if scoring == "maxsim" else sc.blend(alpha, dice, best)


def _slices(pairs: np.ndarray, step: int):
    """``pairs`` in consecutive slices of ``step`` (at least one) each."""
    step = max(1, step)
    return (pairs[i : i + step] for i in range(0, len(pairs), step))


def _stacked(q, rows_q, vectors, rows, dtype) -> np.ndarray:
    """(n, m): ``q[rows_q[j]] @ vectors[rows[j]].T`` for each j, as n stacked (1, dim) x (dim, m)
    products laid out as a lone document's (a query row, the transpose of contiguous vector rows)."""
    a = q[rows_q].astype(dtype, copy=False)
    if q.strides[1] != q.itemsize:  # q's rows have gaps (e.g. q in Fortran order): numpy multiplies such a
        gapped = np.empty((len(a), 2 * a.shape[1]), a.dtype)[:, ::2]  # row without BLAS, so keep gaps
        gapped[...] = a
        a = gapped[:, None, :]
    else:
        a = a.reshape(len(rows_q), 1, q.shape[1])
    b = vectors[rows].astype(dtype, copy=False)  # (n, m, dim)
    return np.matmul(a, b.transpose(0, 2, 1))[:, 0, :]
