"""Multi-vector scorings and evidence@1 from one encoding's raw chunk vectors.

    ms = chunk_scores(q, raw, query_groups, doc_groups)           # MaxSim (n_q, n_docs) + best chunk per pair
    hy = chunk_scores(q, raw, query_groups, doc_groups, "hybrid", doc_vecs, alpha)
    ev = evidence_at_1(top_doc, ms.best_chunk, raw, gold, task.answer_span)

* Scores come from `dice_fast.scoring` (``maxsim``, ``hybrid``): the same functions `DiceIndex`
  ranks with, so the eval measures what the index serves, on L2-normalised vectors (cosines, as
  `retrieval.search` scores document vectors). A query is scored only against the documents of its
  own group (context length); other entries of the (n_q, n_docs) matrices are 0 and
  `retrieval.rank` masks them.
* **evidence@1** of a ranking: the top-ranked document is the gold one *and* its evidence chunk
  (the chunk with the highest cosine to the query, for every scoring: the passage a
  retrieve-by-document, read-by-chunk application hands on) has a character span that contains
  the planted answer (`Task.answer_span`: the 5-digit pass key, the needle's value). So
  evidence@1 <= Hit@1; the gap is the share of correct documents whose best chunk misses the answer.
* **Storage** (`storage_bytes`): what an index keeps per document for each scoring: the document
  vector (``dice``), every chunk vector (``maxsim``), both (``hybrid``), in float32 or float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ChunkScores", "chunk_scores", "evidence_at_1", "storage_bytes"]


@dataclass(frozen=True)
class ChunkScores:
    """A chunk scoring of every (query, candidate document) pair of one encoding.

    scores: (n_q, n_docs) float32 (0 outside the query's group); best_chunk: (n_q, n_docs) int64
    global index (into the raw chunk arrays) of the document's best chunk for the query, -1 outside
    the query's group or for a document without chunks.
    """

    scores: np.ndarray
    best_chunk: np.ndarray


def chunk_scores(query_vecs, raw, query_groups=None, doc_groups=None, scoring: str = "maxsim",
                 doc_vecs=None, alpha: float | None = None, max_block_elems: int = 1 << 23) -> ChunkScores:
    """``scoring`` ("maxsim" or "hybrid", `dice_fast.scoring.score`) of every query against the
    documents of its group, as cosines: queries, chunk vectors and document vectors are
    L2-normalised first.

    query_vecs: (n_q, dim); raw: `chunkstore.RawChunks` (or any object with ``chunks`` (n_chunks,
    dim), ``chunk_document`` (n_chunks,) non-decreasing and ``n_docs``); groups: (n_q,) / (n_docs,)
    labels, both or neither (None: one group; each group's documents contiguous); doc_vecs:
    (n_docs, dim) for "hybrid"; alpha: the hybrid weight (None: `dice_fast.scoring.DEFAULT_ALPHA`).
    max_block_elems: (query, chunk) pairs scored at once: each group's queries run in blocks of
    ``max_block_elems // chunks of the group`` rows (at least one), so the scoring's temporaries (about
    20-25 bytes per pair) stay near 200 MiB at the default 2**23 whatever the sizes; the results do not
    depend on it. What is not blocked: the results themselves, 12 bytes per (query, document) pair.
    """
    from ..scoring import DEFAULT_ALPHA, cu_from_chunk_document, score, unit_rows

    q = unit_rows(query_vecs)
    n_q, n_docs = q.shape[0], int(raw.n_docs)
    qg = np.zeros(n_q, np.int64) if query_groups is None else np.asarray(query_groups)
    dg = np.zeros(n_docs, np.int64) if doc_groups is None else np.asarray(doc_groups)
    d = None if doc_vecs is None else unit_rows(doc_vecs)
    cd = np.asarray(raw.chunk_document, np.int64)
    first = np.searchsorted(cd, np.arange(n_docs + 1), side="left")
    scores = np.zeros((n_q, n_docs), np.float32)
    best = np.full((n_q, n_docs), -1, np.int64)
    for g in np.unique(qg):
        qs, ds = np.flatnonzero(qg == g), np.flatnonzero(dg == g)
        if not ds.size:
            continue
        if np.any(np.diff(ds) != 1):
            raise ValueError(f"documents of group {g} must be contiguous (as the synthetic tasks build them)")
        lo, hi = first[ds[0]], first[ds[-1] + 1]
        cu = cu_from_chunk_document(cd[lo:hi] - ds[0], len(ds))
        chunks, dv = unit_rows(raw.chunks[lo:hi]), None if d is None else d[ds]
        cols = slice(int(ds[0]), int(ds[-1]) + 1)
        rows_per_block = max(1, int(max_block_elems) // max(int(hi - lo), 1))
        for s in range(0, qs.size, rows_per_block):  # query blocks, as retrieval._ranked
            qb = qs[s : s + rows_per_block]
            sc, ev = score(scoring, q[qb], dv, chunks, cu, DEFAULT_ALPHA if alpha is None else alpha)
            scores[qb, cols] = np.where(np.isfinite(sc), sc, 0.0)
            best[qb, cols] = np.where(ev >= 0, ev + lo + cu[:-1][None, :], -1)
            del sc, ev
    return ChunkScores(scores, best)


def evidence_at_1(top_doc, best_chunk, raw, gold, answer_span) -> np.ndarray:
    """(n_q,) float64 1.0 where the top document ``top_doc[i]`` is ``gold[i]`` and its best chunk's
    character span contains ``answer_span[gold[i]]``.

    top_doc: (n_q,) int64 (-1: nothing ranked); best_chunk: (n_q, n_docs) from `chunk_scores`;
    raw: with ``chunk_start_char`` / ``chunk_end_char`` (n_chunks,); gold: (n_q,) int64;
    answer_span: (n_docs, 2) int64.
    """
    top = np.asarray(top_doc, np.int64)
    gold = np.asarray(gold, np.int64)
    if raw.chunk_start_char is None:
        raise ValueError("evidence@1 needs chunk character spans (chunk_start_char / chunk_end_char)")
    ok = (top >= 0) & (top == gold)
    out = np.zeros(top.shape[0], np.float64)
    rows = np.flatnonzero(ok)
    c = best_chunk[rows, top[rows]]
    a = np.asarray(answer_span, np.int64)[top[rows]]
    out[rows] = ((c >= 0) & (raw.chunk_start_char[c] <= a[:, 0]) & (a[:, 1] <= raw.chunk_end_char[c])).astype(np.float64)
    return out


def storage_bytes(n_chunks_per_doc: float, dim: int) -> dict:
    """Bytes per document an index keeps for each scoring: ``{"dice": {"float32": .., "float16": ..},
    "maxsim": {..}, "hybrid": {..}}`` (dice: one document vector; maxsim: every chunk vector;
    hybrid: both)."""
    out = {}
    for name, vectors in (("dice", 1.0), ("maxsim", float(n_chunks_per_doc)), ("hybrid", 1.0 + n_chunks_per_doc)):
        out[name] = {"float32": vectors * dim * 4, "float16": vectors * dim * 2}
    return out
