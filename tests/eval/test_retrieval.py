"""Cosine top-k search, Hit@k and nDCG@k against brute force and hand-computed rankings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dice_fast.eval.retrieval import evaluate, evaluate_ranking, hit_at_k, ndcg_at_k, rank, search


def _brute(q, d, k, qg=None, dg=None):
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    dn = d / np.linalg.norm(d, axis=1, keepdims=True)
    s = (qn.astype(np.float32) @ dn.astype(np.float32).T).astype(np.float64)
    if qg is not None:
        s[qg[:, None] != dg[None, :]] = -np.inf
    order = np.lexsort((np.broadcast_to(np.arange(d.shape[0]), s.shape), -s), axis=1)[:, :k]
    return order, np.take_along_axis(s, order, 1)


@pytest.mark.parametrize("block", [1 << 25, 37])  # one block; many blocks of one query
def test_search_matches_brute_force(block):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((50, 16)).astype(np.float32)
    d = rng.standard_normal((300, 16)).astype(np.float32) * rng.uniform(0.1, 10, (300, 1)).astype(np.float32)
    idx, sc = search(q, d, k=10, max_block_elems=block)
    ref_idx, ref_sc = _brute(q, d, 10)
    assert idx.shape == sc.shape == (50, 10) and idx.dtype == np.int64 and sc.dtype == np.float32
    np.testing.assert_allclose(sc, ref_sc, atol=1e-5)
    np.testing.assert_array_equal(idx, ref_idx)


def test_ties_rank_lower_document_index_first():
    v, w = [1.0, 0.0], [0.0, 1.0]
    docs = np.array([w, v, w, v, v, [1.0, 1.0]], np.float32)
    idx, sc = search(np.array([v, w], np.float32), docs, k=6, max_block_elems=6)
    np.testing.assert_array_equal(idx[0], [1, 3, 4, 5, 0, 2])
    np.testing.assert_array_equal(idx[1], [0, 2, 5, 1, 3, 4])
    np.testing.assert_allclose(sc[0], [1, 1, 1, math.sqrt(0.5), 0, 0], atol=1e-6)
    # a tie straddling the cut-off: the lower indices win the last slots
    idx, _ = search(np.array([v], np.float32), docs, k=2)
    np.testing.assert_array_equal(idx[0], [1, 3])


def test_groups_restrict_candidates_and_pad():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((6, 8))
    d = rng.standard_normal((20, 8))
    qg = np.array([256, 256, 512, 512, 1024, 1024])
    dg = np.array([256] * 8 + [512] * 10 + [1024] * 2)
    idx, sc = search(q, d, k=5, query_groups=qg, doc_groups=dg)
    ref_idx, _ = _brute(q, d, 5, qg, dg)
    for i in range(4):
        np.testing.assert_array_equal(idx[i], ref_idx[i])
        assert set(dg[idx[i]]) == {qg[i]}
    # group 1024 has only 2 candidates: the other slots are -1 / -inf
    assert (idx[4:, :2] >= 18).all() and (idx[4:, 2:] == -1).all() and np.isneginf(sc[4:, 2:]).all()


def test_torch_and_numpy_inputs_agree_and_k_is_capped():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((5, 12)).astype(np.float32)
    d = rng.standard_normal((7, 12)).astype(np.float32)
    a = search(q, d, k=20)
    b = search(torch.from_numpy(q).to(torch.bfloat16).float(), torch.from_numpy(d), k=20)
    assert a[0].shape == (5, 7)  # k capped at n_docs
    np.testing.assert_array_equal(a[0], search(q.astype(np.float64), d, k=20)[0])
    assert b[0].shape == (5, 7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"query_vecs": np.zeros((2, 3)), "doc_vecs": np.zeros((4, 5))}, "doc_vecs has dim 5"),
        ({"query_vecs": np.zeros(3), "doc_vecs": np.zeros((4, 3))}, "query_vecs must be 2-D"),
        ({"query_vecs": np.full((2, 3), np.nan), "doc_vecs": np.ones((4, 3))}, "query_vecs holds NaN"),
        ({"query_vecs": np.ones((2, 3)), "doc_vecs": np.ones((4, 3)), "k": 0}, "k must be a positive int"),
        ({"query_vecs": np.ones((2, 3)), "doc_vecs": np.ones((4, 3)), "query_groups": [0, 0]}, "both"),
        ({"query_vecs": np.ones((2, 3)), "doc_vecs": np.ones((4, 3)), "query_groups": [0, 0],
          "doc_groups": [0, 0, 0]}, r"doc_groups must have shape \(4,\)"),
    ],
)
def test_search_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        search(**kwargs)


def test_hit_at_k_hand_computed():
    ranking = np.array([[4, 2, 7], [1, 0, 3], [5, 6, -1]])
    qrels = [{2: 1}, {1: 1, 9: 1}, {8: 1}]
    np.testing.assert_array_equal(hit_at_k(ranking, qrels, k=1), [0, 1, 0])
    np.testing.assert_array_equal(hit_at_k(ranking, qrels, k=2), [1, 1, 0])
    np.testing.assert_array_equal(hit_at_k(ranking, np.array([4, 3, 5]), k=1), [1, 0, 1])  # one gold index per query
    assert hit_at_k(ranking, [{2: 0}, {}, {5: 2}], k=3).tolist() == [0, 0, 1]  # relevance 0 is not a hit


def test_ndcg_at_10_hand_computed():
    # graded: qrels {3: 2, 7: 1, 9: 1}; doc 9 is judged but never retrieved (it still counts in the ideal)
    ranking = np.array([[5, 3, 1, 7, 0, 2, 4, 6, 8, 10, 9]])
    qrels = [{3: 2, 7: 1, 9: 1}]
    dcg = 2 / math.log2(3) + 1 / math.log2(5)  # ranks 2 and 4; doc 9 at rank 11 is past the cut
    idcg = 2 / math.log2(2) + 1 / math.log2(3) + 1 / math.log2(4)
    assert ndcg_at_k(ranking, qrels, k=10)[0] == pytest.approx(dcg / idcg, rel=1e-12)
    assert dcg / idcg == pytest.approx(1.69254 / 3.13093, abs=1e-5)  # = 0.54059
    # linear gain (trec_eval / pytrec_eval / MTEB), not 2^rel - 1
    assert ndcg_at_k(ranking, qrels, k=10)[0] != pytest.approx((3 / math.log2(3) + 1 / math.log2(5)) / (3 + 1 / math.log2(3) + 0.5))
    # binary: the single gold at rank 3 -> 1 / log2(4) = 0.5; at rank 1 -> 1; absent -> 0; no relevant -> 0
    ranking = np.array([[9, 8, 1, 2], [1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4]])
    got = ndcg_at_k(ranking, [{1: 1}, {1: 1}, {1: 1}, {}], k=10)
    np.testing.assert_allclose(got, [0.5, 1.0, 0.0, 0.0])
    # k cuts the ranking: gold at rank 3 with k=2 -> 0
    assert ndcg_at_k(ranking[:1], [{1: 1}], k=2)[0] == 0.0


def test_metric_errors():
    with pytest.raises(ValueError, match="qrels has 1 entries but there are 2 queries"):
        hit_at_k(np.zeros((2, 3), np.int64), [{0: 1}])
    with pytest.raises(ValueError, match="indices must be a 2-D integer array"):
        ndcg_at_k(np.zeros(3, np.int64), [{0: 1}])


def test_evaluate_grouped_report():
    # 4 groups, 2 queries each; query vectors equal to their gold document -> hit, except where noted
    rng = np.random.default_rng(3)
    d = rng.standard_normal((16, 32))
    groups = np.repeat([1024, 4096, 8192, 32768], 4)
    gold = np.array([0, 1, 4, 5, 8, 9, 12, 13])
    q = d[gold].copy()
    q[2] = d[6]    # group 4096, query 2 retrieves doc 6 first: miss
    q[6] = -d[12]  # group 32768: gold ranks last among 4
    out = evaluate(q, d, gold, query_groups=groups[gold], doc_groups=groups)
    assert out["groups"][1024]["hit@1"] == 1.0 and out["groups"][4096]["hit@1"] == 0.5
    assert out["groups"][32768]["hit@1"] == 0.5
    assert out["hit@1<=4096"] == pytest.approx(0.75) and out["hit@1>4096"] == pytest.approx(0.75)
    assert out["hit@1"] == pytest.approx(0.75) and out["n_queries"] == 8
    assert out["groups"][32768]["ndcg@10"] == pytest.approx((1 + 1 / math.log2(5)) / 2)
    flat = evaluate(q, d, gold)
    assert set(flat) == {"n_queries", "hit@1", "ndcg@10", "per_query"}


def test_rank_of_precomputed_scores_equals_search():
    rng = np.random.default_rng(3)
    q, d = rng.standard_normal((30, 8)), rng.standard_normal((40, 8))
    qg, dg = np.repeat([1, 2, 3], 10), np.repeat([1, 2, 3, 4], 10)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    dn = d / np.linalg.norm(d, axis=1, keepdims=True)
    scores = (qn.astype(np.float32) @ dn.astype(np.float32).T)
    scores[:, 7] = scores[:, 3]  # a tie: the lower index ranks first
    for block in (1 << 25, 50):
        got = rank(scores, k=10, query_groups=qg, doc_groups=dg, max_block_elems=block)
        want = _rank_brute(scores, 10, qg, dg)
        np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(rank(scores[:, :10], k=3)[0], _rank_brute(scores[:, :10], 3))
    with pytest.raises(ValueError, match="scores holds NaN"):
        rank(np.full((2, 3), np.nan), k=1)
    with pytest.raises(ValueError, match="both query_groups and doc_groups"):
        rank(scores, k=1, query_groups=qg)


def _rank_brute(s, k, qg=None, dg=None):
    s = s.astype(np.float64).copy()
    if qg is not None:
        s[qg[:, None] != dg[None, :]] = -np.inf
    order = np.lexsort((np.broadcast_to(np.arange(s.shape[1]), s.shape), -s), axis=1)[:, :k]
    return np.where(np.isneginf(np.take_along_axis(s, order, 1)), -1, order)


def test_evaluate_ranking_averages_per_query_metrics_by_group():
    idx = np.array([[0, 1], [1, 0], [2, 3], [3, 2]])
    qrels = [0, 0, 2, 2]
    ev = evaluate_ranking(idx, qrels, query_groups=[256, 256, 8192, 8192],
                          per_query={"evidence@1": np.array([1.0, 0.0, 0.0, 0.0])})
    assert ev["groups"][256]["hit@1"] == 0.5 and ev["groups"][8192]["hit@1"] == 0.5
    assert ev["groups"][256]["evidence@1"] == 0.5 and ev["groups"][8192]["evidence@1"] == 0.0
    assert ev["evidence@1<=4096"] == 0.5 and ev["evidence@1>4096"] == 0.0 and ev["evidence@1"] == 0.25
    np.testing.assert_array_equal(ev["per_query"]["hit@1"], [1, 0, 1, 0])
    with pytest.raises(ValueError, match="per_query"):
        evaluate_ranking(idx, qrels, per_query={"x": np.zeros(3)})
