"""evidence@1 and storage per document, on hand-made spans; MaxSim / hybrid rows of run_eval against
brute-force float64 scoring of the same chunk vectors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dice_fast.eval.evidence import evidence_at_1, storage_bytes


def test_evidence_needs_the_gold_document_and_a_covering_chunk():
    # 2 documents x 2 chunks: doc 0 = chars [0, 10) + [10, 20); doc 1 = [0, 8) + [8, 30)
    raw = SimpleNamespace(chunk_start_char=np.array([0, 10, 0, 8]), chunk_end_char=np.array([10, 20, 8, 30]))
    answer = np.array([[12, 15], [7, 9]])          # doc 0's answer lies in its chunk 1; doc 1's straddles
    top = np.array([0, 0, 1, -1])
    chunk = np.array([1, 0, 3, -1])                # the top document's evidence chunk (global index)
    gold = np.array([0, 0, 1, 1])
    got = evidence_at_1(top, chunk, raw, gold, answer)
    # q0: gold ranked first, chunk 1 covers [12, 15); q1: gold first but chunk 0 misses it;
    # q2: chunk 3 = [8, 30) misses 7; q3: nothing ranked
    np.testing.assert_array_equal(got, [1.0, 0.0, 0.0, 0.0])
    answer2 = np.array([[12, 15], [9, 12]])
    np.testing.assert_array_equal(evidence_at_1(top, chunk, raw, gold, answer2), [1.0, 0.0, 1.0, 0.0])
    # a wrong top document never counts, even when its best chunk would cover the gold's answer offsets
    np.testing.assert_array_equal(evidence_at_1(np.array([1, 1, 0, 0]), np.array([3, 3, 1, 1]), raw, gold, answer2),
                                  [0, 0, 0, 0])
    with pytest.raises(ValueError, match="character spans"):
        evidence_at_1(top, chunk, SimpleNamespace(chunk_start_char=None, chunk_end_char=None), gold, answer)


def test_storage_per_document():
    s = storage_bytes(128, 384)  # a 32k-token document in chunks of 254 tokens + 1
    assert s["dice"] == {"float32": 1536, "float16": 768}
    assert s["maxsim"]["float32"] == 128 * 1536 and s["maxsim"]["float16"] == 128 * 768
    assert s["hybrid"]["float32"] == 129 * 1536


def _brute_rows(enc, task, chunk_size, alpha):
    """float64 brute force of MaxSim, hybrid (mean document vector) and evidence@1 on ``task``."""
    from dice_fast.eval.run import raw_twin

    out = raw_twin(enc, chunk_size=chunk_size, normalize_chunks=False, aggregation="mean").encode_documents(
        task.corpus, return_chunks=True)
    docs = raw_twin(enc, chunk_size=chunk_size).encode_documents(task.corpus).astype(np.float64)
    q = enc.encode_queries(task.queries).astype(np.float64)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    q, docs, chunks = unit(q), unit(docs), unit(out.chunks.astype(np.float64))
    gold = task.gold_document()
    rows = {"maxsim": [], "hybrid": [], "evidence": []}
    for i in range(len(task.queries)):
        cand = np.flatnonzero(task.doc_length == task.query_length[i])
        ms, best = [], []
        for d in cand:
            c = np.flatnonzero(out.chunk_document == d)
            s = chunks[c] @ q[i]
            ms.append(s.max())
            best.append(c[int(np.argmax(s))])
        ms = np.array(ms)
        hy = alpha * (docs[cand] @ q[i]) + (1 - alpha) * ms
        top_ms, top_hy = cand[int(np.argmax(ms))], cand[int(np.argmax(hy))]
        rows["maxsim"].append(float(top_ms == gold[i]))
        rows["hybrid"].append(float(top_hy == gold[i]))
        b = best[int(np.argmax(ms))]
        a0, a1 = task.answer_span[gold[i]]
        rows["evidence"].append(float(top_ms == gold[i] and out.chunk_start_char[b] <= a0
                                      and a1 <= out.chunk_end_char[b]))
    return {k: np.array(v) for k, v in rows.items()}


def test_run_eval_maxsim_hybrid_and_evidence_equal_brute_force(tiny_result):
    enc, task, res = tiny_result
    for k in (16, 40):
        hybrid = f"k{k}-hybrid@0.3"
        assert f"k{k}-maxsim" in res.methods and res.method_info[hybrid]["alpha"] == 0.3
        want = _brute_rows(enc, task, k, 0.3)
        for g in res.groups:
            sel = task.query_length == g
            assert res.metrics[f"k{k}-maxsim"]["hit@1"][g] == pytest.approx(want["maxsim"][sel].mean())
            assert res.metrics[hybrid]["hit@1"][g] == pytest.approx(want["hybrid"][sel].mean())
            assert res.metrics[f"k{k}-maxsim"]["evidence@1"][g] == pytest.approx(want["evidence"][sel].mean())
            for m in res.methods[1:]:  # evidence@1 <= Hit@1 for every chunked method
                assert res.metrics[m]["evidence@1"][g] <= res.metrics[m]["hit@1"][g] + 1e-12
    assert res.extra["hybrid_alphas"] == (0.3,)


def _blocks_case(scoring):
    rng = np.random.default_rng(5)
    per_doc = np.array([3, 0, 2, 4, 1, 2, 5, 3])                # document 1 has no chunk
    chunk_document = np.repeat(np.arange(per_doc.size), per_doc)
    chunks = rng.standard_normal((chunk_document.size, 6)).astype(np.float32)
    raw = SimpleNamespace(chunks=chunks, chunk_document=chunk_document, n_docs=per_doc.size)
    q = rng.standard_normal((7, 6)).astype(np.float32)
    qg, dg = np.array([0, 1, 0, 1, 1, 0, 0]), np.array([0, 0, 0, 0, 1, 1, 1, 1])
    docs = rng.standard_normal((per_doc.size, 6)).astype(np.float32) if scoring == "hybrid" else None
    return q, raw, qg, dg, docs


@pytest.mark.parametrize("scoring", ["maxsim", "hybrid"])
def test_chunk_ranking_equals_ranking_the_full_score_matrix(scoring):
    """Ranked block by block (each block's top k kept), as `retrieval.rank` ranks the whole (queries x
    documents) matrix the eval used to hold, down to a budget of one query per block, with groups and
    an empty document; the evidence chunk of each ranked document is its best chunk by cosine."""
    from dice_fast.eval.evidence import chunk_ranking, evidence_chunks
    from dice_fast.eval.retrieval import rank
    from dice_fast.scoring import cu_from_chunk_document, score, unit_rows

    q, raw, qg, dg, docs = _blocks_case(scoring)
    full = np.zeros((len(q), raw.n_docs), np.float32)
    cu = cu_from_chunk_document(raw.chunk_document, raw.n_docs)
    sc, ev = score(scoring, unit_rows(q), None if docs is None else unit_rows(docs), unit_rows(raw.chunks), cu, 0.3)
    full[:] = np.where(np.isfinite(sc), sc, 0.0)
    for k in (1, 3, 8, 20):
        want_idx, want_sc = rank(full, k=k, query_groups=qg, doc_groups=dg)
        for budget in (1, 5, 13, 1 << 30):
            idx, got_sc = chunk_ranking(q, raw, qg, dg, scoring, docs, 0.3, k=k, max_block_elems=budget)
            np.testing.assert_array_equal(idx, want_idx, err_msg=f"k={k} budget={budget}")
            np.testing.assert_allclose(got_sc, want_sc, rtol=1e-6, atol=1e-6)
    assert (want_idx[qg == 1][:, 4:] == -1).all()             # group 1 has 4 documents
    top = want_idx[:, 0]
    want_chunk = np.where((top >= 0) & (ev[np.arange(len(q)), np.maximum(top, 0)] >= 0),
                          cu[np.maximum(top, 0)] + ev[np.arange(len(q)), np.maximum(top, 0)], -1)
    np.testing.assert_array_equal(evidence_chunks(q, raw, top), want_chunk)
    np.testing.assert_array_equal(evidence_chunks(q, raw, np.array([1, -1, 1, 1, 1, 1, 1])), -1)  # no chunks


def test_chunk_ranking_memory_does_not_grow_with_queries_times_documents():
    """Peak memory follows the block and the top k, not queries x documents (the eval held 12 bytes
    per pair: float32 scores and int64 best chunks)."""
    import tracemalloc

    from dice_fast.eval.evidence import chunk_ranking

    rng = np.random.default_rng(0)
    n_q, n_docs, per = 400, 8000, 2
    raw = SimpleNamespace(chunks=rng.standard_normal((n_docs * per, 8)).astype(np.float32),
                          chunk_document=np.repeat(np.arange(n_docs), per), n_docs=n_docs)
    q = rng.standard_normal((n_q, 8)).astype(np.float32)
    tracemalloc.start()
    try:
        chunk_ranking(q, raw, max_block_elems=1 << 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < n_q * n_docs * 4, peak  # less than the float32 scores alone
