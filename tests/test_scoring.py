"""dice_fast.scoring against a per-document Python loop in float64."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dice_fast import scoring
from dice_fast.errors import OptionError


def _corpus(seed=0, n_docs=9, dim=8):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5, n_docs)
    counts[0] = 0  # a document without chunks
    chunks = rng.standard_normal((int(counts.sum()), dim))
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    documents = rng.standard_normal((n_docs, dim))
    queries = rng.standard_normal((4, dim))
    return queries, documents, chunks, cu


def _brute(queries, documents, chunks, cu, scoring_name, alpha):
    n_q, n_d = len(queries), len(documents)
    score, evidence = np.zeros((n_q, n_d)), np.full((n_q, n_d), -1)
    for i, q in enumerate(queries):
        for d in range(n_d):
            per_chunk = [float(q @ chunks[c]) for c in range(cu[d], cu[d + 1])]
            best = max(per_chunk) if per_chunk else -np.inf
            evidence[i, d] = per_chunk.index(best) if per_chunk else -1
            doc = float(q @ documents[d])
            score[i, d] = {"dice": doc, "maxsim": best, "hybrid": alpha * doc + (1 - alpha) * best}[scoring_name]
    return score, evidence


@pytest.mark.parametrize("name", scoring.SCORINGS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_scorings_equal_a_brute_force_loop(name, dtype):
    q, d, c, cu = _corpus()
    got, evidence = scoring.score(name, q.astype(dtype), d.astype(dtype), c.astype(dtype), cu, alpha=0.3)
    want, want_evidence = _brute(q, d, c, cu, name, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
    np.testing.assert_array_equal(evidence, want_evidence)


def test_ties_take_the_first_chunk_and_chunk_document_gives_offsets():
    chunks = np.array([[1.0, 0], [1.0, 0], [0, 1.0], [0, 1.0]])
    cu = scoring.cu_from_chunk_document(np.array([0, 0, 2, 2]), 3)
    assert cu.tolist() == [0, 2, 2, 4]
    best, index = scoring.maxsim(np.array([[1.0, 1.0]]), chunks, cu)
    assert best.tolist() == [[1.0, -np.inf, 1.0]] and index.tolist() == [[0, -1, 0]]


def test_bad_arguments_are_named():
    q, d, c, cu = _corpus()
    with pytest.raises(ValueError, match="unknown scoring 'bm25'"):
        scoring.score("bm25", q, d, c, cu)
    for alpha in (1.5, None, "x", float("nan"), True):  # None and "x" raised bare TypeError / ValueError
        with pytest.raises(OptionError, match=f"alpha must be a number between 0 and 1, got {re.escape(repr(alpha))}"):
            scoring.hybrid(q, d, c, cu, alpha=alpha)
    assert scoring.check_alpha(np.float32(0.5)) == 0.5 and scoring.check_alpha(1) == 1.0
    with pytest.raises(ValueError, match="needs chunk vectors"):
        scoring.score("maxsim", q, d, None, None)
    with pytest.raises(ValueError, match="widths differ"):
        scoring.dice(q[:, :3], d)


def test_a_zero_weight_contributes_nothing_to_the_hybrid_blend():
    queries, documents, chunks, cu = _corpus()  # document 0 has no chunks: maxsim -inf
    dice, _ = scoring.dice(queries, documents)
    maxsim, _ = scoring.maxsim(queries, chunks, cu)
    np.testing.assert_array_equal(scoring.hybrid(queries, documents, chunks, cu, alpha=1.0)[0], dice)
    np.testing.assert_array_equal(scoring.hybrid(queries, documents, chunks, cu, alpha=0.0)[0], maxsim)
    assert np.all(scoring.hybrid(queries, documents, chunks, cu, alpha=0.5)[0][:, 0] == -np.inf)


def test_a_nan_chunk_score_is_skipped_and_all_nan_gives_no_evidence():
    """A non-finite chunk vector scores NaN: its document's other chunks still decide (fmax); a document
    whose every chunk is NaN has evidence -1 (it was int64 max: an index the server read past its chunks)."""
    q = np.array([[1.0, 0.0]], np.float32)
    scores = np.array([[np.nan, 0.5, np.nan, np.nan, 0.2]], np.float32)
    best, index = scoring.best_chunks(scores, np.array([0, 2, 4, 5]))
    assert best[0, 0] == 0.5 and index[0, 0] == 1
    assert np.isnan(best[0, 1]) and index[0, 1] == -1
    assert best[0, 2] == np.float32(0.2) and index[0, 2] == 0
    chunks = np.array([[np.inf, 0.0], [1.0, 0.0], [0.0, 1.0]], np.float32)
    _, evidence = scoring.maxsim(q, scoring.unit_rows(chunks), np.array([0, 2, 3]))
    assert evidence.tolist() == [[1, 0]]
