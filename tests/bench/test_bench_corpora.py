"""Benchmark inputs: corpus length profiles and prose documents cut to token counts."""

from __future__ import annotations

import numpy as np
import pytest

from dice_fast.bench.corpora import corpus_lengths, make_corpus, word_tokenizer


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
    assert make_corpus(tok, lengths, seed=0) == docs and make_corpus(tok, lengths, seed=1) != docs
