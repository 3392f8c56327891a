"""Raw chunk vectors encoded once per distinct chunk, and their disk cache: equal to the engine's own
chunk vectors, reused only for the same model, chunk-shaping options and texts."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dice_fast import DiceEncoder
from dice_fast.eval.chunkstore import cache_key, encode_raw_chunks
from dice_fast.eval.run import raw_twin
from helpers import assert_close
from tiny_models import tiny

REPEAT = "the grass is green. the sky is blue. " * 12
TEXTS = [REPEAT, "", "a different text entirely, " * 9, REPEAT + "a key 12345. " + REPEAT, "x", REPEAT]


@pytest.fixture(scope="module")
def tiny_bert():
    model, tok, *_ = tiny("bert")
    return model, tok


@pytest.mark.parametrize("options", [dict(chunk_size=8), dict(chunk_size=16, overlap=5, document_prefix="passage: "),
                                     dict(chunk_size=8, positions="global"), dict(strategy="single")])
def test_equal_to_encode_documents(tiny_bert, options):
    enc = DiceEncoder(*tiny_bert, normalize_chunks=False, **options)
    texts = [t[:120] for t in TEXTS] if options.get("positions") == "global" else TEXTS  # within the positions
    want = enc.encode_documents(texts, return_chunks=True)
    got = encode_raw_chunks(enc, texts)
    assert_close(got.chunks, want.chunks, 1e-5, 1e-5, what=str(options))
    for f in ("chunk_document", "chunk_start", "chunk_end"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
    np.testing.assert_array_equal(got.chunk_weights, want.chunk_end - want.chunk_start + enc.chunk_overhead)
    assert got.n_docs == len(texts)
    if options.get("positions") == "global":
        assert got.n_distinct == got.chunks.shape[0]  # a chunk's vector depends on its offset: no copies
    elif options.get("strategy") == "single":
        assert got.chunks.shape[0] == len(TEXTS) and got.n_distinct == 5  # TEXTS[0] and [5] are one window
    else:
        assert got.n_distinct < got.chunks.shape[0] // 2  # the repeated text is run once


def test_cache_round_trip_and_key(tiny_bert, tmp_path):
    enc = DiceEncoder(*tiny_bert, chunk_size=8, normalize_chunks=False)
    first = encode_raw_chunks(enc, TEXTS, cache_dir=tmp_path)
    assert not first.from_cache and first.tokens_run > 0
    (path,) = tmp_path.iterdir()
    again = encode_raw_chunks(enc, TEXTS, cache_dir=tmp_path)
    assert again.from_cache and again.tokens_run == 0
    np.testing.assert_array_equal(again.chunks, first.chunks)
    # options applied after pooling share the key; anything that shapes a chunk or the texts does not
    assert cache_key(raw_twin(enc, aggregation="max", top_k=5, normalize=False), TEXTS) == cache_key(enc, TEXTS)
    assert cache_key(raw_twin(enc, chunk_size=9), TEXTS) != cache_key(enc, TEXTS)
    assert cache_key(raw_twin(enc, document_prefix="p: "), TEXTS) != cache_key(enc, TEXTS)
    assert cache_key(enc, TEXTS[:-1]) != cache_key(enc, TEXTS)
    assert cache_key(enc, ["ab", "c"]) != cache_key(enc, ["a", "bc"])
    # a damaged file is recomputed and rewritten, never trusted
    path.write_bytes(b"not an npz")
    fixed = encode_raw_chunks(enc, TEXTS, cache_dir=tmp_path)
    assert not fixed.from_cache
    np.testing.assert_array_equal(fixed.chunks, first.chunks)
    assert encode_raw_chunks(enc, TEXTS, cache_dir=tmp_path).from_cache
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    os.remove(path)


def test_refuses_normalised_chunks(tiny_bert):
    with pytest.raises(ValueError, match="normalize_chunks=False"):
        encode_raw_chunks(DiceEncoder(*tiny_bert, normalize_chunks=True), TEXTS)
