"""EC / EDI (DESIGN.md §1, paper §2.2) against hand-computed values and a per-sample loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dice_fast.eval.diagnostics import EvidenceStats, evidence_stats


def _unit(cos: float) -> list[float]:
    """A 2-d unit vector whose cosine with the query (1, 0) is ``cos``."""
    return [cos, math.sqrt(1.0 - cos * cos)]


# gold-document chunk cosines a_j, and cos(q, d) of two methods, per sample (query i -> document i)
CASES = [
    # a_j                 single  dice     m     ā      EC        EDI single      EDI dice
    ([0.9, 0.5, 0.1],     0.3,    0.7),  # 0.9   0.5    0.4/0.9   0.6/0.4=1.5     0.2/0.4=0.5
    ([0.2, 0.6],          0.5,    0.65), # 0.6   0.4    0.2/0.6   0.1/0.2=0.5     -0.05/0.2=-0.25 (negative)
    ([0.5, 0.495],        0.1,    0.2),  # margin 0.0025 < 0.01: filtered
    ([0.7],               0.6,    0.7),  # one chunk: margin 0, filtered
    ([-0.2, -0.6],        -0.5,   -0.3), # m<0: EC = 0.2/|-0.2| = 1; EDI 0.3/0.2=1.5, 0.1/0.2=0.5
    ([0.8, 0.2],          0.6,    0.5),  # 0.8   0.5    0.3/0.8   0.2/0.3         0.3/0.3=1.0 (dice worse)
]
EXPECTED = {
    "m": [0.9, 0.6, 0.5, 0.7, -0.2, 0.8],
    "a_mean": [0.5, 0.4, 0.4975, 0.7, -0.4, 0.5],
    "ec": [0.4 / 0.9, 0.2 / 0.6, 0.0025 / 0.5, 0.0, 1.0, 0.3 / 0.8],
    "single": [1.5, 0.5, 0.4 / 0.0025, 0.1 / 1e-8, 1.5, 0.2 / 0.3],
    "dice": [0.5, -0.25, 0.3 / 0.0025, 0.0, 0.5, 1.0],
    "kept": [True, True, False, False, True, True],
}


def _inputs(extra_scale: float = 1.0):
    chunks, chunk_doc, single, dice = [], [], [], []
    for d, (a, s1, s2) in enumerate(CASES):
        chunks += [_unit(x) for x in a]
        chunk_doc += [d] * len(a)
        single.append(_unit(s1))
        dice.append(_unit(s2))
    # document 6 has no chunks and is nobody's gold: allowed
    single.append([0.0, 1.0])
    dice.append([0.0, 1.0])
    q = np.tile([[1.0, 0.0]], (len(CASES), 1)) * extra_scale
    return (q, np.array(chunks) * 3.0, np.array(chunk_doc), np.arange(len(CASES)),
            {"single": np.array(single) * 0.5, "dice": np.array(dice)})


def test_hand_computed_values():
    stats = evidence_stats(*_inputs(extra_scale=7.0))  # no vector is unit length: cosines normalise
    assert isinstance(stats, EvidenceStats)
    np.testing.assert_allclose(stats.m, EXPECTED["m"], atol=1e-12)
    np.testing.assert_allclose(stats.a_mean, EXPECTED["a_mean"], atol=1e-12)
    np.testing.assert_array_equal(stats.n_chunks, [3, 2, 2, 1, 2, 2])
    np.testing.assert_allclose(stats.ec, EXPECTED["ec"], rtol=1e-7, atol=1e-9)
    np.testing.assert_array_equal(stats.kept, EXPECTED["kept"])
    for method in ("single", "dice"):
        np.testing.assert_allclose(stats.edi[method][stats.kept], np.array(EXPECTED[method])[stats.kept], rtol=1e-7)
    assert stats.edi["dice"][1] < 0  # the document vector beats the best chunk
    np.testing.assert_allclose(stats.edi["dice"][2], 0.3 / 0.0025, rtol=1e-5)  # filtered, still reported
    assert stats.edi["single"][3] > 1e6  # zero margin: ε keeps it finite, the filter drops it


def test_summary_and_share_lower():
    stats = evidence_stats(*_inputs())
    s = stats.summary()
    assert s["n_samples"] == 6 and s["n_kept"] == 4
    # kept samples 0, 1, 4, 5
    assert s["median_ec"] == pytest.approx(np.median([0.4 / 0.9, 0.2 / 0.6, 1.0, 0.3 / 0.8]), rel=1e-7)
    assert s["median_edi"]["single"] == pytest.approx(np.median([1.5, 0.5, 1.5, 0.2 / 0.3]), rel=1e-7)
    assert s["median_edi"]["dice"] == pytest.approx(np.median([0.5, -0.25, 0.5, 1.0]), rel=1e-7)
    assert s["median_margin"] == pytest.approx(np.median([0.4, 0.2, 0.2, 0.3]), rel=1e-9)
    assert stats.share_lower("dice", "single") == pytest.approx(3 / 4)
    assert stats.share_lower("single", "dice") == pytest.approx(1 / 4)
    assert stats.share_lower("dice", "dice") == 0.0  # ties are not "lower"
    with pytest.raises(KeyError, match="unknown method"):
        stats.share_lower("dice", "nope")


def test_filter_threshold_is_a_parameter():
    stats = evidence_stats(*_inputs(), min_margin=0.001)
    np.testing.assert_array_equal(stats.kept, [True, True, True, False, True, True])
    stats = evidence_stats(*_inputs(), min_margin=0.25)
    np.testing.assert_array_equal(stats.kept, [True, False, False, False, False, True])
    none = evidence_stats(*_inputs(), min_margin=10.0)
    assert none.summary()["n_kept"] == 0 and math.isnan(none.summary()["median_ec"])
    assert math.isnan(none.share_lower("dice", "single"))


def test_eps_default_and_override():
    q, c, cd, gold, docs = _inputs()
    stats = evidence_stats(q, c, cd, gold, docs, eps=0.1)
    assert stats.eps == 0.1 and stats.min_margin == 0.01
    np.testing.assert_allclose(stats.ec[0], 0.4 / (0.9 + 0.1), rtol=1e-9)
    np.testing.assert_allclose(stats.edi["single"][0], 0.6 / (0.4 + 0.1), rtol=1e-9)
    assert evidence_stats(q, c, cd, gold, docs).eps == 1e-8


def test_torch_inputs_match_numpy():
    q, c, cd, gold, docs = _inputs()
    ref = evidence_stats(q, c, cd, gold, docs)
    got = evidence_stats(torch.tensor(q, dtype=torch.float32), torch.tensor(c, dtype=torch.float32),
                         torch.tensor(cd), torch.tensor(gold), {k: torch.tensor(v) for k, v in docs.items()})
    np.testing.assert_allclose(got.ec, ref.ec, rtol=1e-5, atol=1e-6)
    for k in docs:
        np.testing.assert_allclose(got.scores[k], ref.scores[k], atol=1e-6)


def _loop_reference(q, c, cd, gold, docs, eps, min_margin):
    def cos(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(x @ y / (max(np.linalg.norm(x), 1e-12) * max(np.linalg.norm(y), 1e-12)))

    out = {"m": [], "a_mean": [], "ec": [], "kept": [], **{k: [] for k in docs}}
    for i, g in enumerate(gold):
        a = [cos(q[i], c[j]) for j in np.flatnonzero(cd == g)]
        m, abar = max(a), float(np.mean(a))
        out["m"].append(m)
        out["a_mean"].append(abar)
        out["ec"].append((m - abar) / (abs(m) + eps))
        out["kept"].append(m - abar >= min_margin)
        for k, d in docs.items():
            out[k].append((m - cos(q[i], d[g])) / (m - abar + eps))
    return out


def test_matches_per_sample_loop_on_random_data():
    rng = np.random.default_rng(0)
    n_docs, dim = 40, 24
    counts = rng.integers(0, 9, n_docs)  # some documents without chunks, some with one
    cd = np.repeat(np.arange(n_docs), counts)
    c = rng.standard_normal((cd.size, dim)).astype(np.float32)
    docs = {"a": rng.standard_normal((n_docs, dim)), "b": rng.standard_normal((n_docs, dim)).astype(np.float32)}
    with_chunks = np.flatnonzero(counts > 0)
    gold = rng.choice(with_chunks, 300)
    q = rng.standard_normal((gold.size, dim)).astype(np.float32)
    got = evidence_stats(q, c, cd, gold, docs)
    ref = _loop_reference(q, c, cd, gold, docs, 1e-8, 0.01)
    for key in ("m", "a_mean", "ec"):
        np.testing.assert_allclose(getattr(got, key), ref[key], rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(got.kept, ref["kept"])
    for k in docs:
        np.testing.assert_allclose(got.edi[k][got.kept], np.array(ref[k])[got.kept], rtol=1e-8, atol=1e-10)
    assert 0 < got.kept.sum() < gold.size


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(q=a["q"][:, :1]), "chunk_vecs has dim"),
        (lambda a: a.update(q=a["q"][0]), "query_vecs must be 2-D"),
        (lambda a: a.update(cd=a["cd"][:-1]), "chunk_document has"),
        (lambda a: a.update(cd=a["cd"][::-1].copy()), "chunk_document must be non-decreasing"),
        (lambda a: a.update(cd=a["cd"] + 10), r"chunk_document values must lie in"),
        (lambda a: a.update(cd=a["cd"].astype(float)), "chunk_document must hold integers"),
        (lambda a: a.update(gold=a["gold"][:-1]), "gold_document has"),
        (lambda a: a.update(gold=a["gold"] + 100), "gold_document values must lie in"),
        (lambda a: a.update(gold=np.array([6] * 6)), r"gold_document\[0\] = 6 has no chunks"),
        (lambda a: a.update(docs={}), "document_vecs_by_method must be a non-empty dict"),
        (lambda a: a.update(docs={"x": np.zeros((7, 2)), "y": np.zeros((5, 2))}),
         r"document_vecs_by_method\['y'\] has 5 documents"),
        (lambda a: a.update(docs={"x": np.zeros((7, 3))}), r"document_vecs_by_method\['x'\] has dim 3"),
    ],
)
def test_errors_name_the_argument(mutate, match):
    q, c, cd, gold, docs = _inputs()
    args = {"q": q, "c": c, "cd": cd, "gold": gold, "docs": docs}
    mutate(args)
    with pytest.raises(ValueError, match=match):
        evidence_stats(args["q"], args["c"], args["cd"], args["gold"], args["docs"])
