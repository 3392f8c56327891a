"""Multi-vector scorings and evidence@1 from one encoding's raw chunk vectors.

    idx, sc = chunk_ranking(q, raw, query_groups, doc_groups, k=10)   # MaxSim top-10 (n_q, 10) each
    idx, sc = chunk_ranking(q, raw, query_groups, doc_groups, "hybrid", doc_vecs, alpha)
    ev = evidence_at_1(idx[:, 0], evidence_chunks(q, raw, idx[:, 0]), raw, gold, task.answer_span)

* Scores come from `dice_fast.scoring` (``maxsim``, ``hybrid``, `score_only`): the same functions `DiceIndex`
  ranks with, so the eval measures what the index serves, on L2-normalised vectors (cosines, as
  `retrieval.search` scores document vectors). A query is scored only against the documents of its
  own group (context length), in blocks of queries, keeping each block's top k: no (queries x
  documents) array is ever held.
* **evidence@1** of a ranking: the top-ranked document is the gold one *and* its evidence chunk
  (the chunk with the highest cosine to the query, for every scoring: the passage a
  retrieve-by-document, read-by-chunk application hands on) has a character span that contains
  the planted answer (`Task.answer_span`: the 5-digit pass key, the needle's value). So
  evidence@1 <= Hit@1; the gap is the share of correct documents whose best chunk misses the answer.
* **Storage** (`storage_bytes`): what an index keeps per document for each scoring: the document
  vector (``dice``), every chunk vector (``maxsim``), both (``hybrid``), in float32 or float16.
"""

from __future__ import annotations

import numpy as np

__all__ = ["chunk_ranking", "evidence_at_1", "evidence_chunks", "storage_bytes"]


def chunk_ranking(query_vecs, raw, query_groups=None, doc_groups=None, scoring: str = "maxsim", doc_vecs=None,
                  alpha: float | None = None, k: int = 10, max_block_elems: int = 1 << 23):
    """Top-``k`` documents of every query under ``scoring`` ("maxsim" or "hybrid",
    `dice_fast.scoring.score`) among the documents of its group, as cosines: queries, chunk vectors
    and document vectors are L2-normalised first. Returns (indices, scores): (n_q, min(k, n_docs))
    int64 best first, ties to the lower document index, -1 where a query has fewer candidates, and
    float32 scores (-inf there) — what `retrieval.rank` gives for the full score matrix (a score that
    is not finite, a document without chunks under maxsim, counts 0).

    query_vecs: (n_q, dim); raw: `chunkstore.RawChunks` (or any object with ``chunks`` (n_chunks,
    dim), ``chunk_document`` (n_chunks,) non-decreasing and ``n_docs``); groups: (n_q,) / (n_docs,)
    labels, both or neither (None: one group; each group's documents contiguous); doc_vecs:
    (n_docs, dim) for "hybrid"; alpha: the hybrid weight (None: `dice_fast.scoring.DEFAULT_ALPHA`).
    max_block_elems: (query, chunk) pairs scored at once: each group's queries run in blocks of
    ``max_block_elems // chunks of the group`` rows (at least one), so the temporaries (about 20-25
    bytes per pair) stay near 200 MiB at the default 2**23, and only each block's top ``k`` is kept:
    memory does not grow with queries x documents. The results do not depend on it (up to float32
    rounding of the products).
    """
    from ..scoring import DEFAULT_ALPHA, cu_from_chunk_document, score_only, unit_rows
    from .retrieval import rank

    q = unit_rows(query_vecs)
    n_q, n_docs = q.shape[0], int(raw.n_docs)
    qg = np.zeros(n_q, np.int64) if query_groups is None else np.asarray(query_groups)
    dg = np.zeros(n_docs, np.int64) if doc_groups is None else np.asarray(doc_groups)
    d = None if doc_vecs is None else unit_rows(doc_vecs)
    cd = np.asarray(raw.chunk_document, np.int64)
    first = np.searchsorted(cd, np.arange(n_docs + 1), side="left")
    kk = min(int(k), n_docs)
    indices, scores = np.full((n_q, kk), -1, np.int64), np.full((n_q, kk), -np.inf, np.float32)
    for g in np.unique(qg):
        qs, ds = np.flatnonzero(qg == g), np.flatnonzero(dg == g)
        if not ds.size or not kk:
            continue
        if np.any(np.diff(ds) != 1):
            raise ValueError(f"documents of group {g} must be contiguous (as the synthetic tasks build them)")
        lo, hi = first[ds[0]], first[ds[-1] + 1]
        cu = cu_from_chunk_document(cd[lo:hi] - ds[0], len(ds))
        chunks, dv = unit_rows(raw.chunks[lo:hi]), None if d is None else d[ds]
        rows_per_block = max(1, int(max_block_elems) // max(int(hi - lo), 1))
        for s in range(0, qs.size, rows_per_block):  # query blocks, as retrieval._ranked
            qb = qs[s : s + rows_per_block]
            sc = score_only(scoring, q[qb], dv, chunks, cu, DEFAULT_ALPHA if alpha is None else alpha)
            idx, val = rank(np.where(np.isfinite(sc), sc, 0.0).astype(np.float32), k=kk)
            indices[qb, : idx.shape[1]] = np.where(idx >= 0, idx + ds[0], -1)
            scores[qb, : val.shape[1]] = val
    return indices, scores


def evidence_chunks(query_vecs, raw, docs) -> np.ndarray:
    """(n_q,) int64: the global index (into the raw chunk arrays) of the chunk of document ``docs[i]``
    with the highest cosine to query ``i`` (the first on ties; NaN skipped), -1 where ``docs[i]`` is -1
    or the document has no chunks. query_vecs: (n_q, dim); raw as in `chunk_ranking`; docs: (n_q,)."""
    from ..scoring import maxsim, unit_rows

    q = unit_rows(query_vecs)
    docs = np.asarray(docs, np.int64)
    first = np.searchsorted(np.asarray(raw.chunk_document, np.int64), np.arange(int(raw.n_docs) + 1), side="left")
    out = np.full(docs.shape[0], -1, np.int64)
    for i in np.flatnonzero(docs >= 0):
        lo, hi = first[docs[i]], first[docs[i] + 1]
        if hi > lo:
            _, ev = maxsim(q[i : i + 1], unit_rows(raw.chunks[lo:hi]), np.array([0, hi - lo]))
            out[i] = lo + ev[0, 0] if ev[0, 0] >= 0 else -1
    return out


def evidence_at_1(top_doc, top_chunk, raw, gold, answer_span) -> np.ndarray:
    """(n_q,) float64 1.0 where the top document ``top_doc[i]`` is ``gold[i]`` and its evidence chunk
    ``top_chunk[i]``'s character span contains ``answer_span[gold[i]]``.

    top_doc: (n_q,) int64 (-1: nothing ranked); top_chunk: (n_q,) int64 from `evidence_chunks` of
    ``top_doc`` (-1: none); raw: with ``chunk_start_char`` / ``chunk_end_char`` (n_chunks,); gold:
    (n_q,) int64; answer_span: (n_docs, 2) int64.
    """
    top = np.asarray(top_doc, np.int64)
    gold = np.asarray(gold, np.int64)
    if raw.chunk_start_char is None:
        raise ValueError("evidence@1 needs chunk character spans (chunk_start_char / chunk_end_char)")
    ok = (top >= 0) & (top == gold)
    out = np.zeros(top.shape[0], np.float64)
    rows = np.flatnonzero(ok)
    c = np.asarray(top_chunk, np.int64)[rows]
    a = np.asarray(answer_span, np.int64)[top[rows]]
    covered = (c >= 0) & (raw.chunk_start_char[c] <= a[:, 0]) & (a[:, 1] <= raw.chunk_end_char[c])
    out[rows] = covered.astype(np.float64)
    return out


def storage_bytes(n_chunks_per_doc: float, dim: int) -> dict:
    """Bytes per document an index keeps for each scoring: ``{"dice": {"float32": .., "float16": ..},
    "maxsim": {..}, "hybrid": {..}}`` (dice: one document vector; maxsim: every chunk vector;
    hybrid: both)."""
    out = {}
    for name, vectors in (("dice", 1.0), ("maxsim", float(n_chunks_per_doc)), ("hybrid", 1.0 + n_chunks_per_doc)):
        out[name] = {"float32": vectors * dim * 4, "float16": vectors * dim * 2}
    return out
