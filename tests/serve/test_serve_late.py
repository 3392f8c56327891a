"""Late chunking through the server: the request field ``strategy`` ("dice", "single", "late") on
/v1/embeddings and /v1/evidence gives exactly the offline vectors of an encoder with that strategy,
beside requests of the server's own strategy; a bad value or one the encoder cannot take is a 400
naming ``strategy``; the server client of the adapters sends it through."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from dice_fast import DiceEncoder, scoring
from dice_fast.integrations._server_client import ServerEmbedder
from dice_fast.serve import create_app
from helpers import assert_close
from serve_testing import ServerThread, word_texts
from tiny_models import tiny


@pytest.fixture(scope="module")
def late_twin(tiny_encoder):
    return DiceEncoder(tiny_encoder.model, tiny_encoder.tokenizer, config=tiny_encoder.config.replace(strategy="late"))


@pytest.fixture(scope="module")
def server(tiny_encoder):
    app = create_app(tiny_encoder, max_inputs_per_request=8, max_tokens_per_document=4000)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=120) as client:
        yield s, client


def test_strategy_field_equals_offline(server, tiny_encoder, late_twin):
    _, client = server
    texts = word_texts(5, 1, 300, seed=41)  # some longer than one 128-token window
    want = late_twin.encode_documents(texts, return_chunks=True)
    r = client.post("/v1/embeddings", json={"input": texts, "return_chunks": True, "strategy": "late",
                                            "encoding_format": "float"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert_close(np.array([d["embedding"] for d in data], np.float32), want.documents, 1e-5)
    chunks = [c for d in data for c in d["chunks"]]
    assert_close(np.array([c["embedding"] for c in chunks], np.float32), want.chunks, 1e-5)
    assert [c["start_char"] for c in chunks] == want.chunk_start_char.tolist()
    dice = client.post("/v1/embeddings", json={"input": texts, "strategy": None}).json()["data"]
    assert_close(np.array([d["embedding"] for d in dice], np.float32), tiny_encoder.encode_documents(texts), 1e-5)
    single = client.post("/v1/embeddings", json={"input": texts, "strategy": "single"}).json()["data"]
    want_single = DiceEncoder(tiny_encoder.model, tiny_encoder.tokenizer,
                              config=tiny_encoder.config.replace(strategy="single")).encode_documents(texts)
    assert_close(np.array([d["embedding"] for d in single], np.float32), want_single, 1e-5)
    q = client.post("/v1/embeddings", json={"input": ["a cat"], "input_type": "query", "strategy": "late"})
    assert q.status_code == 200  # queries are one window under every strategy


def test_evidence_with_late_chunks(server, late_twin):
    _, client = server
    texts, query = word_texts(4, 10, 200, seed=42), "the cat sat on a mat"
    out = late_twin.encode_documents(texts, return_chunks=True)
    q = late_twin.encode_queries([query])
    cu = scoring.cu_from_chunk_document(out.chunk_document, len(texts))
    want, evidence = scoring.score("maxsim", q, out.documents, scoring.unit_rows(out.chunks), cu)
    r = client.post("/v1/evidence", json={"query": query, "documents": texts, "strategy": "late"})
    assert r.status_code == 200, r.text
    rows = r.json()["data"]
    np.testing.assert_allclose([row["score"] for row in rows], want[0], atol=1e-5)
    assert [row["chunk"] for row in rows] == evidence[0].tolist()


@pytest.mark.parametrize("value", ["LATE", "", 3, True, ["late"]])
def test_bad_strategy_is_named(server, value):
    _, client = server
    for route, body in (("/v1/embeddings", {"input": ["a cat"]}), ("/v1/evidence", {"query": "q", "documents": ["a"]})):
        r = client.post(route, json={**body, "strategy": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "strategy", r.text


def test_a_strategy_the_encoder_cannot_take_is_named():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=16, pooling="cls")
    with ServerThread(create_app(enc)) as s, httpx.Client(base_url=s.url, timeout=60) as client:
        r = client.post("/v1/embeddings", json={"input": ["a cat sat"], "strategy": "late"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "strategy", r.text
        assert "pooling" in r.json()["error"]["message"]
        assert client.post("/v1/embeddings", json={"input": ["a cat sat"]}).status_code == 200


def test_the_server_client_sends_the_strategy(server, late_twin):
    s, _ = server
    texts = word_texts(3, 5, 200, seed=43)
    got = ServerEmbedder(s.url, strategy="late").documents(texts)
    assert_close(got, late_twin.encode_documents(texts), 1e-5)
    assert_close(ServerEmbedder(s.url, strategy="late").queries(["a cat"]), late_twin.encode_queries(["a cat"]), 1e-5)
    with pytest.raises(Exception, match="strategy"):
        ServerEmbedder(s.url, strategy="bogus")
