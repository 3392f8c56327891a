"""The benchmark harness and the naive baselines it measures against (functional, not timed)."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from dice_fast import DiceEncoder
from dice_fast.baselines import encode_padded
from dice_fast.bench import append_csv, benchmark, corpus_lengths, format_table, make_corpus, word_tokenizer
from helpers import assert_close
from test_engine import corpus
from tiny_models import tiny


@pytest.mark.parametrize("arch,pooling", [("bert", "mean"), ("qwen2", "last"), ("roberta", "cls")])
def test_padded_baseline_equals_the_engine(arch, pooling):
    model, tok, *_ = tiny(arch)
    enc = DiceEncoder(model, tok, chunk_size=8, pooling=pooling, max_batch_tokens=50)
    texts = [t for t in corpus() if t]  # the padded path needs at least one token per chunk
    assert_close(encode_padded(enc, texts, batch_size=3), enc.encode_documents(texts), 1e-5, what="padded vs engine")


def test_corpus_lengths_bands_and_determinism():
    mixed = corpus_lengths("mixed", 2000, seed=1, longest=32768)
    assert mixed.min() >= 32 and mixed.max() <= 32768
    assert 0.6 < (mixed < 512).mean() < 0.8 and (mixed >= 4096).mean() < 0.1
    assert np.array_equal(mixed, corpus_lengths("mixed", 2000, seed=1, longest=32768))
    assert corpus_lengths("short", 50).max() <= 256 and corpus_lengths("long", 5).min() >= 4096
    with pytest.raises(ValueError, match="unknown corpus 'tiny'"):
        corpus_lengths("tiny", 3)


def test_make_corpus_hits_token_counts():
    tok = word_tokenizer()
    lengths = np.array([40, 300, 5000])
    docs = make_corpus(tok, lengths, seed=0)
    got = [len(tok(d, add_special_tokens=False)["input_ids"]) for d in docs]
    assert all(abs(g - n) <= 0.02 * n + 2 for g, n in zip(got, lengths)), got


def test_benchmark_rows_and_csv(tmp_path):
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=8)
    texts = [t for t in corpus() if t][:6]
    rows = benchmark({"float32": enc}, texts, "unit", "tiny-bert", repeats=1)
    assert [r.path for r in rows] == ["dice_fast", "padded"]
    for r in rows:
        assert r.seconds_median > 0 and r.docs_per_s > 0 and r.min_cosine_vs_engine > 0.99999
    assert rows[0].n_docs == 6 and rows[0].doc_tokens == sum(len(t.split()) for t in texts)
    out = tmp_path / "r.csv"
    append_csv(rows, out)
    append_csv(rows, out)
    with open(out) as fh:
        assert len(list(csv.DictReader(fh))) == 4
    assert "| tiny-bert | unit | dice_fast | float32 |" in format_table(rows)
