"""The queries of an encode job: the ones cut to the model window named once, by id."""

from __future__ import annotations

import warnings

import dice_fast.corpus.query_blocks as qb
from dice_fast import DiceEncoder
from dice_fast.chunking import TruncatedWarning
from tiny_models import tiny


def test_cut_queries_are_counted_and_only_the_first_three_kept(monkeypatch):
    """Every cut query's (id, tokens) was kept for the job's one warning, which names three: a job of
    passages as queries (nearly every row cut) grew by ~160 bytes a row without bound."""
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, max_length=12)
    monkeypatch.setattr(qb, "BATCH", 4)
    texts = ["word " * (20 + i) if i % 3 else "short" for i in range(11)]  # 7 of 11 cut, over 3 blocks
    blocks = qb.QueryBlocks(enc, iter(texts), None)
    start = 0
    for block in blocks:
        blocks.note([f"q{start + i}" for i in range(len(block))])
        start += len(block)
    assert start == 11 and len(blocks._truncated) <= 3
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        blocks.warn()
    [w] = [w for w in seen if issubclass(w.category, TruncatedWarning)]
    assert str(w.message).startswith("7 queries longer than the model window")
    assert "id 'q1' (21 tokens), id 'q2' (22 tokens), id 'q4' (24 tokens) ..." in str(w.message)
