"""Exact cosine top-k retrieval and the LongEmbed metrics (Hit@k, nDCG@k).

    idx, scores = search(query_vecs, doc_vecs, k=10)                      # (n_q, 10) each
    hit_at_k(idx, qrels, k=1).mean(), ndcg_at_k(idx, qrels, k=10).mean()
    evaluate(query_vecs, doc_vecs, task.qrels,                            # LongEmbed-style report
             query_groups=task.query_length, doc_groups=task.doc_length)

* Vectors may be numpy arrays or torch tensors of any float dtype; both sides are L2-normalised
  here (rows divided by ``max(norm, 1e-12)``) and scored in float32, on the tensors' device when
  both are torch tensors on the same device, else on the CPU.
* The score matrix is built ``max_block_elems`` entries at a time (query blocks), so 10k x 100k
  never holds more than one block (default 2**25 floats = 128 MiB).
* Ties are broken deterministically: equal scores rank the lower document index first.
* Groups: with ``query_groups``/``doc_groups`` a query only sees documents of its own group (LongEmbed
  passkey/needle: the candidates of a query are the documents of its context length). Slots a query
  cannot fill (fewer candidates than ``k``) hold index -1 and score -inf.
* qrels: one ``{doc_index: relevance}`` dict per query (graded or binary), or one gold document
  index per query (relevance 1).
* nDCG follows trec_eval's ``ndcg_cut`` (what pytrec_eval, and through it BEIR and MTEB, report):
  linear gain ``DCG@k = sum_{r<=k} rel_r / log2(r + 1)``, the ideal DCG taken over *all* judged
  documents of the query with relevance > 0 (not only the retrieved ones); a query without relevant
  documents scores 0. Note trec_eval itself breaks score ties by document id string, we by index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..ops.spec import NORM_EPS
from ._arrays import as_int_1d, to_numpy

__all__ = ["search", "rank", "hit_at_k", "ndcg_at_k", "evaluate", "evaluate_ranking"]


def search(query_vecs, doc_vecs, k: int = 10, *, query_groups=None, doc_groups=None,
           max_block_elems: int = 1 << 25) -> tuple[np.ndarray, np.ndarray]:
    """Cosine top-k: query_vecs (n_q, dim), doc_vecs (n_docs, dim) -> (indices, scores).

    indices: (n_q, min(k, n_docs)) int64, best first, ties to the lower document index, -1 where a
    query has fewer candidates than k; scores: same shape, float32 cosine, -inf where index is -1.
    query_groups: (n_q,) and doc_groups: (n_docs,) integer labels, both or neither: a query is
    scored only against documents with its own label.
    """
    import torch

    q = _as_tensor(query_vecs, "query_vecs")
    d = _as_tensor(doc_vecs, "doc_vecs")
    if q.shape[1] != d.shape[1]:
        raise ValueError(f"doc_vecs has dim {d.shape[1]} but query_vecs has dim {q.shape[1]}")
    _check_k_and_groups(k, query_groups, doc_groups)
    device = q.device if q.device == d.device else torch.device("cpu")
    q, d = _normalise(q.to(device)), _normalise(d.to(device))
    return _ranked(lambda a, b: q[a:b] @ d.T, q.shape[0], d.shape[0], k, query_groups, doc_groups,
                   max_block_elems, device)


def rank(scores, k: int = 10, *, query_groups=None, doc_groups=None,
         max_block_elems: int = 1 << 25) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of precomputed scores (n_q, n_docs) (numpy or torch, higher is better; e.g. MaxSim or a
    hybrid from `dice_fast.scoring`) -> (indices, scores) exactly as `search` ranks cosines: (n_q,
    min(k, n_docs)) int64 best first, ties to the lower index, -1 / -inf where a query has fewer
    candidates than k; groups as in `search`."""
    s = _as_tensor(scores, "scores")
    _check_k_and_groups(k, query_groups, doc_groups)
    return _ranked(lambda a, b: s[a:b].clone(), s.shape[0], s.shape[1], k, query_groups, doc_groups,
                   max_block_elems, s.device)


def _check_k_and_groups(k, query_groups, doc_groups) -> None:
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if (query_groups is None) != (doc_groups is None):
        raise ValueError("pass both query_groups and doc_groups, or neither")


def _ranked(block_scores, n_q: int, n_docs: int, k: int, query_groups, doc_groups, max_block_elems, device):
    """Top-k rows of the score matrix whose rows [a, b) ``block_scores(a, b)`` returns (a fresh tensor)."""
    import torch

    kk = min(int(k), n_docs)
    out_idx = np.full((n_q, kk), -1, np.int64)
    out_sc = np.full((n_q, kk), -np.inf, np.float32)
    if n_q == 0 or kk == 0:
        return out_idx, out_sc
    if query_groups is not None:
        qg = torch.as_tensor(as_int_1d(query_groups, "query_groups", n_q), device=device)
        dg = torch.as_tensor(as_int_1d(doc_groups, "doc_groups", n_docs), device=device)
    rows_per_block = max(1, int(max_block_elems) // n_docs)
    ar = torch.arange(kk, device=device)
    for s in range(0, n_q, rows_per_block):
        sc = block_scores(s, s + rows_per_block)                       # (b, n_docs)
        if query_groups is not None:
            sc.masked_fill_(qg[s : s + rows_per_block, None] != dg[None, :], -math.inf)
        # every entry >= the k-th best value is a candidate (more than k only when tied)
        thr = torch.topk(sc, kk, dim=1, sorted=True).values[:, -1:]
        rows, cols = torch.nonzero(sc >= thr, as_tuple=True)           # row-major: cols ascending
        vals = sc[rows, cols]
        order = torch.sort(-vals, stable=True).indices                 # score desc, col asc on ties
        order = order[torch.sort(rows[order], stable=True).indices]    # then grouped by row
        counts = torch.bincount(rows, minlength=sc.shape[0])
        starts = torch.cumsum(counts, 0) - counts
        take = order[starts[:, None] + ar[None, :]]                    # (b, kk): counts >= kk always
        idx, val = cols[take], vals[take]
        idx = torch.where(torch.isneginf(val), torch.full_like(idx, -1), idx)
        out_idx[s : s + sc.shape[0]] = idx.cpu().numpy()
        out_sc[s : s + sc.shape[0]] = val.cpu().numpy()
    return out_idx, out_sc


def hit_at_k(indices, qrels, k: int = 1) -> np.ndarray:
    """indices: (n_q, >=k) ranked document indices (from `search`) -> (n_q,) float64, 1.0 when a
    document with relevance > 0 is among the first k."""
    rels, _ = _ranked_relevance(indices, qrels, k)
    return (rels > 0).any(axis=1).astype(np.float64)


def ndcg_at_k(indices, qrels, k: int = 10) -> np.ndarray:
    """indices: (n_q, >=k) ranked document indices -> (n_q,) float64 nDCG@k (trec_eval ndcg_cut:
    linear gain, log2(rank + 1) discount, ideal over all judged relevant documents)."""
    rels, qrels = _ranked_relevance(indices, qrels, k)
    discount = 1.0 / np.log2(np.arange(2, k + 2, dtype=np.float64))
    gains = np.where(rels > 0, rels, 0.0)
    dcg = gains @ discount[: gains.shape[1]]
    out = np.zeros(rels.shape[0], np.float64)
    for i, qr in enumerate(qrels):
        ideal = np.sort(np.array([r for r in qr.values() if r > 0], np.float64))[::-1][:k]
        if ideal.size:
            out[i] = dcg[i] / (ideal @ discount[: ideal.size])
    return out


def evaluate(query_vecs, doc_vecs, qrels, *, query_groups=None, doc_groups=None,
             split_at: int = 4096) -> dict:
    """Hit@1 and nDCG@10 of cosine retrieval: query_vecs (n_q, dim), doc_vecs (n_docs, dim).

    Without groups: ``{"n_queries", "hit@1", "ndcg@10"}`` (means over queries). With groups (context
    lengths): also ``"groups": {length: {"n_queries", "hit@1", "ndcg@10"}}``; "hit@1"/"ndcg@10" are
    then the macro averages over groups (LongEmbed's "avg"), and ``"hit@1<=4096"``,
    ``"hit@1>4096"`` (likewise nDCG) macro-average the groups at most / above ``split_at`` (the
    paper's "≤ 4k" and "> 4k" columns; a side with no group is left out).
    """
    idx, _ = search(query_vecs, doc_vecs, k=10, query_groups=query_groups, doc_groups=doc_groups)
    return evaluate_ranking(idx, qrels, query_groups=query_groups, split_at=split_at)


def evaluate_ranking(indices, qrels, *, query_groups=None, split_at: int = 4096, per_query: dict | None = None) -> dict:
    """`evaluate`'s report from a ranking: indices (n_q, >=10) from `search` or `rank`.

    ``per_query``: extra (n_q,) arrays (e.g. evidence@1) averaged like Hit@1 into the report under
    their keys. The report also holds ``"per_query": {"hit@1": (n_q,), "ndcg@10": (n_q,), ...}``.
    """
    idx = indices
    hit, ndcg = hit_at_k(idx, qrels, 1), ndcg_at_k(idx, qrels, 10)
    metrics = {"hit@1": hit, "ndcg@10": ndcg, **(per_query or {})}
    for name, v in metrics.items():
        if np.shape(v) != hit.shape:
            raise ValueError(f"per_query[{name!r}] must have shape {hit.shape}, got {np.shape(v)}")
    if query_groups is None:
        return {"n_queries": int(hit.size), **{m: _mean(np.asarray(v, np.float64)) for m, v in metrics.items()},
                "per_query": metrics}
    qg = as_int_1d(query_groups, "query_groups", hit.size)
    groups = {}
    for g in np.unique(qg):
        sel = qg == g
        groups[int(g)] = {"n_queries": int(sel.sum()), **{m: _mean(np.asarray(v, np.float64)[sel])
                                                          for m, v in metrics.items()}}
    out = {"n_queries": int(hit.size)}
    for metric in metrics:
        out[metric] = _mean(np.array([v[metric] for v in groups.values()]))
    for side, pick in ((f"<={split_at}", lambda g: g <= split_at), (f">{split_at}", lambda g: g > split_at)):
        vals = [v for g, v in groups.items() if pick(g)]
        if vals:
            for metric in metrics:
                out[f"{metric}{side}"] = _mean(np.array([v[metric] for v in vals]))
    out["groups"] = groups
    out["per_query"] = metrics
    return out


# ------------------------------------------------------------------------------------------------
def _as_tensor(x, what: str):
    import torch

    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.ndim != 2:
        raise ValueError(f"{what} must be 2-D (rows, dim), got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{what} must hold floats, got {t.dtype}")
    t = t.float()
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what} holds NaN or inf")
    return t


def _normalise(t):
    return t / t.norm(dim=1, keepdim=True).clamp_min(NORM_EPS)


def _as_qrels(qrels, n_q: int) -> list[Mapping]:
    """One {doc_index: relevance} mapping per query, or one gold index per query -> list of mappings."""
    if hasattr(qrels, "detach"):
        qrels = to_numpy(qrels, "qrels")
    if isinstance(qrels, np.ndarray):
        if qrels.ndim != 1 or not np.issubdtype(qrels.dtype, np.integer):
            raise ValueError(f"qrels as an array must be 1-D integers (one gold document per query), got "
                             f"shape {qrels.shape} dtype {qrels.dtype}")
        qrels = [{int(g): 1} for g in qrels]
    elif isinstance(qrels, Sequence) and not isinstance(qrels, (str, bytes)):
        qrels = [{int(r): 1} if isinstance(r, (int, np.integer)) else r for r in qrels]
    else:
        raise ValueError("qrels must be a list of {doc_index: relevance} dicts or of gold indices")
    if len(qrels) != n_q:
        raise ValueError(f"qrels has {len(qrels)} entries but there are {n_q} queries")
    for i, r in enumerate(qrels):
        if not isinstance(r, Mapping):
            raise ValueError(f"qrels[{i}] must be a dict {{doc_index: relevance}} or an int, got {type(r).__name__}")
    return qrels


def _ranked_relevance(indices, qrels, k: int) -> tuple[np.ndarray, list[Mapping]]:
    """indices (n_q, n_ranked) -> (rel (n_q, min(k, n_ranked)) float64 relevance at each rank, qrels as a list)."""
    idx = to_numpy(indices, "indices")
    if idx.ndim != 2 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise ValueError(f"indices must be a 2-D integer array (n_queries, n_ranked), got shape {idx.shape}")
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    qrels = _as_qrels(qrels, idx.shape[0])
    top = idx[:, :k]
    rels = np.zeros(top.shape, np.float64)
    for i, qr in enumerate(qrels):
        if qr:
            rels[i] = [qr.get(int(j), 0) if j >= 0 else 0 for j in top[i]]
    return rels, qrels


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else float("nan")
