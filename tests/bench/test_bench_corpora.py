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


@pytest.mark.parametrize("name,billions", [("bert-base", 0.085), ("modernbert-base", 0.110), ("qwen2-1.5b", 1.31)])
def test_random_models_have_their_namesakes_size(name, billions):
    """Each benchmark architecture builds (on the meta device: no memory, no time) with the size of
    the model it stands for: non-embedding parameters within 10 %."""
    import torch

    from dice_fast.bench.corpora import random_model

    model, tok = random_model(name, torch.device("meta"), torch.float32)
    n = sum(p.numel() for n_, p in model.named_parameters() if "embed" not in n_)
    assert abs(n / 1e9 - billions) <= 0.1 * billions, f"{name}: {n / 1e9:.3f}B non-embedding parameters"
    assert model.config.vocab_size == len(tok)
