"""Raw chunk vectors through the engine: equal to its own chunk vectors, identical chunks run once
(seen in `ChunkStats`), and the chunk cache reused across calls and encoders, a damaged row recomputed."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from dice_fast import DiceEncoder
from dice_fast.reuse.persistent import CACHE_FILE
from dice_fast.eval.chunkstore import encode_raw_chunks
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
    tokens = []
    got = encode_raw_chunks(enc, texts, progress=lambda d, t: tokens.append((d, t)))
    assert_close(got.chunks, want.chunks, 1e-6, 1e-6, what=str(options))
    for f in ("chunk_document", "chunk_start", "chunk_end", "chunk_start_char", "chunk_end_char"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
    plan = enc.plan(texts)
    np.testing.assert_array_equal(got.chunk_weights, plan.chunk_weights)
    assert got.n_docs == len(texts) and sum(d for d, _ in tokens) == len(texts)
    assert got.tokens_run == sum(t for _, t in tokens) > 0 and not got.from_cache
    if options.get("positions") == "global":  # a chunk's vector depends on its offset: only equal offsets copy
        assert got.n_computed == len({(bytes(plan.tokens.ids[plan.tokens.offsets[d] + s:][:n]), s)
                                      for d, s, n in zip(plan.chunks.document, plan.chunks.start, plan.chunks.length)})
    elif options.get("strategy") == "single":
        assert got.chunks.shape[0] == len(TEXTS) and got.n_computed == 5  # TEXTS[0] and [5] are one window
    else:
        assert got.n_computed < got.chunks.shape[0] // 2  # the repeated text is run once
    assert got.tokens_run <= plan.chunk_lengths.sum()  # copies are not run


def test_chunk_cache_reused_and_damage_recomputed(tiny_bert, tmp_path):
    enc = DiceEncoder(*tiny_bert, chunk_size=8, normalize_chunks=False)
    want = encode_raw_chunks(enc, TEXTS)
    cached = raw_twin(enc, cache=tmp_path)
    first = encode_raw_chunks(cached, TEXTS)
    assert not first.from_cache and first.n_computed == want.n_computed and cached.chunk_stats.written > 0
    np.testing.assert_array_equal(first.chunks, want.chunks)
    # a warm re-run (another encoder, options applied after pooling differ) computes nothing
    again_enc = raw_twin(enc, cache=tmp_path, aggregation="max", top_k=5, normalize=False)
    again = encode_raw_chunks(again_enc, TEXTS)
    assert again.from_cache and again.tokens_run == 0 and again_enc.chunk_stats.computed == 0
    assert again.n_computed == 0 and again.n_cached == want.chunks.shape[0]  # every chunk, copies too
    np.testing.assert_array_equal(again.chunks, want.chunks)
    # a damaged row is dropped and recomputed, never returned
    with sqlite3.connect(tmp_path / CACHE_FILE) as con:
        key, vec = con.execute("SELECT key, vec FROM chunks ORDER BY key LIMIT 1").fetchone()
        con.execute("UPDATE chunks SET vec=? WHERE key=?", (vec[:5] + bytes([vec[5] ^ 1]) + vec[6:], key))
    damaged_enc = raw_twin(enc, cache=tmp_path)
    fixed = encode_raw_chunks(damaged_enc, TEXTS)
    assert damaged_enc.chunk_stats.damaged == 1 and damaged_enc.chunk_stats.computed == 1 and not fixed.from_cache
    assert_close(fixed.chunks, want.chunks, 1e-6, 1e-6, what="after damage")  # recomputed in another batch
    # options that shape a chunk miss the cache
    prefixed = raw_twin(enc, cache=tmp_path, document_prefix="p: ")
    assert not encode_raw_chunks(prefixed, TEXTS).from_cache and prefixed.chunk_stats.disk_hits == 0

def test_refuses_normalised_chunks(tiny_bert):
    with pytest.raises(ValueError, match="normalize_chunks=False"):
        encode_raw_chunks(DiceEncoder(*tiny_bert, normalize_chunks=True), TEXTS)
