"""Summaries across eval runs on hand-made results: the normalize_chunks table counts wins per
(task, length) cell; the hybrid alpha is the best dev mean Hit@1 (ties: nDCG@10, then nearest 0.5)."""

from __future__ import annotations

import numpy as np
import pytest

from dice_fast.eval.ablation import choose_alpha, normalize_chunks_table, scoring_table
from dice_fast.eval.run import EvalResult, method_key


def _result(task, metrics, info):
    groups = [256, 8192]
    return EvalResult(task=task, groups=groups, methods=list(metrics), method_info=info, metrics=metrics,
                      n_queries={g: 50 for g in groups}, edi={}, edi_group=np.zeros(0, np.int64), timings={},
                      check={}, info={}, extra={"default_normalize_chunks": True})


def _ablation(task, norm, raw):
    metrics, info = {}, {}
    for nc, vals in ((True, norm), (False, raw)):
        key = method_key(64, "mean", nc)
        metrics[key] = {"hit@1": dict(zip([256, 8192], vals)), "evidence@1": dict(zip([256, 8192], vals))}
        info[key] = {"label": f"DICE mean k=64 {nc}", "chunk_size": 64, "aggregation": "mean", "scoring": "dice",
                     "normalize_chunks": nc, "alpha": None}
    return _result(task, metrics, info)


def test_normalize_chunks_table_counts_cells():
    md, tot = normalize_chunks_table([_ablation("passkey", (0.8, 0.6), (0.8, 0.4)),
                                      _ablation("needle", (0.2, 0.1), (0.3, 0.1))])
    assert "| 64 | mean | 70.0 | 60.0 | -10.0 | 15.0 | 20.0 | +5.0 | 1 | 1 | 2 |" in md
    assert tot == {"raw": 1, "norm": 1, "tie": 2, "mean_diff": pytest.approx(-2.5)}


def _dev(hits, ndcgs):
    metrics, info = {}, {}
    for alpha, h, n in zip((0.0, 0.5, 1.0), hits, ndcgs):
        key = method_key(128, "hybrid", None, alpha)
        metrics[key] = {"hit@1": {256: h, 8192: h}, "ndcg@10": {256: n, 8192: n}}
        info[key] = {"label": key, "chunk_size": 128, "aggregation": "hybrid", "scoring": "hybrid",
                     "normalize_chunks": None, "alpha": alpha}
    return _result("passkey", metrics, info)


def test_choose_alpha_by_dev_hit_then_ndcg_then_nearest_half():
    assert choose_alpha([_dev((0.5, 0.7, 0.6), (0.1, 0.1, 0.1))])[0] == 0.5
    assert choose_alpha([_dev((0.7, 0.5, 0.7), (0.1, 0.1, 0.2))])[0] == 1.0
    alpha, md = choose_alpha([_dev((0.7, 0.5, 0.7), (0.1, 0.1, 0.1))])
    assert alpha == 0.0 and "| 0.5 | 50.0 | **50.0** |" in md  # a tie at 0 and 1: equally near 0.5, the first
    with pytest.raises(ValueError, match="alpha grid"):
        choose_alpha([_ablation("passkey", (1, 1), (1, 1))])


def test_scoring_table_one_setting_two_metrics():
    md = scoring_table(_ablation("passkey", (0.8, 0.6), (0.8, 0.4)))
    assert md.splitlines()[2] == "| DICE mean k=64 True | 80 / 80 | 60 / 60 | 80 / 80 | 60 / 60 |"
    assert len(md.splitlines()) == 3  # the raw rows belong to the other setting
