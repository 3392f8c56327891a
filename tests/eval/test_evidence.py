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
    best = np.array([[1, 2], [0, 3], [1, 3], [1, 3]])  # best chunk of (query, document)
    top = np.array([0, 0, 1, -1])
    gold = np.array([0, 0, 1, 1])
    got = evidence_at_1(top, best, raw, gold, answer)
    # q0: gold ranked first, chunk 1 covers [12, 15); q1: gold first but chunk 0 misses it;
    # q2: chunk 3 = [8, 30) misses 7; q3: nothing ranked
    np.testing.assert_array_equal(got, [1.0, 0.0, 0.0, 0.0])
    answer2 = np.array([[12, 15], [9, 12]])
    np.testing.assert_array_equal(evidence_at_1(top, best, raw, gold, answer2), [1.0, 0.0, 1.0, 0.0])
    # a wrong top document never counts, even when its best chunk would cover the gold's answer offsets
    np.testing.assert_array_equal(evidence_at_1(np.array([1, 1, 0, 0]), best, raw, gold, answer2), [0, 0, 0, 0])
    with pytest.raises(ValueError, match="character spans"):
        evidence_at_1(top, best, SimpleNamespace(chunk_start_char=None, chunk_end_char=None), gold, answer)


def test_storage_per_document():
    s = storage_bytes(128, 384)  # a 32k-token document in chunks of 254 tokens + 1
    assert s["dice"] == {"float32": 1536, "float16": 768}
    assert s["maxsim"]["float32"] == 128 * 1536 and s["maxsim"]["float16"] == 128 * 768
    assert s["hybrid"]["float32"] == 129 * 1536
