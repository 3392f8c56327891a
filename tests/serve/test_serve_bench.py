"""The server benchmark's parts: the corpus, the closed-loop clients against a real server, the table."""

from __future__ import annotations

import asyncio

import numpy as np

from dice_fast.serve import create_app
from dice_fast.serve.bench import _closed_loop, format_table, make_corpus
from serve_testing import ServerThread, word_texts


def test_make_corpus_cuts_prose_to_token_lengths(real_encoder):
    docs = make_corpus(real_encoder.tokenizer, 20, 16, 300, seed=3)
    lengths = real_encoder.plan(docs).tokens.lengths
    assert len(docs) == 20 and lengths.min() >= 12 and lengths.max() <= 310  # re-tokenizing a cut moves it a little
    assert make_corpus(real_encoder.tokenizer, 20, 16, 300, seed=3) == docs


def test_closed_loop_clients_check_every_response(tiny_encoder):
    texts = word_texts(30, 1, 60, seed=30)
    ref = tiny_encoder.encode_documents(texts)
    requests = [[i, (i + 1) % 30] for i in range(30)]
    with ServerThread(create_app(tiny_encoder, max_queue_tokens=10**6)) as server:
        res = asyncio.run(_closed_loop(server.url, requests, texts, ref, 8, "base64", timeout=120))
    assert res["requests"] == 30 and res["max_abs_err"] < 1e-5
    assert res["tokens"] == 2 * int(tiny_encoder.plan(texts).document_tokens.sum())
    assert 0 < res["p50_ms"] <= res["p99_ms"] and res["seconds"] > 0
    table = format_table([{"batching": "offline encode_documents", "clients": "", "docs_per_s": 10.0,
                           "tokens_per_s": 1000.0, "vs_offline": 1.0},
                          {"batching": "cross-request", "clients": 8, "docs_per_s": 9.5, "tokens_per_s": 950.0,
                           "p50_ms": res["p50_ms"], "p99_ms": res["p99_ms"], "vs_offline": 0.95,
                           "vs_per_request": 2.0}])
    assert "| cross-request | 8 | 9.5 | 950 |" in table and "0.95x | 2.00x |" in table
    assert np.isfinite(res["seconds"])
