"""Chunks and evidence over HTTP (uvicorn on 127.0.0.1, httpx): ``return_chunks`` equals offline
``encode_documents(return_chunks=True)``; ``/v1/evidence`` equals the offline scoring and finds a
planted sentence with the bundled model; bad bodies get 400 naming the field."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from dice_fast import scoring
from dice_fast.data import prose
from dice_fast.serve import create_app
from helpers import assert_close
from serve_testing import ServerThread, word_texts

PLANTED = "The silver key to the lighthouse is hidden beneath the third blue stone."


@pytest.fixture(scope="module")
def tiny_server(tiny_encoder):
    app = create_app(tiny_encoder, max_inputs_per_request=8, max_tokens_per_document=400)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _vector(value, fmt):
    if fmt == "base64":
        return np.frombuffer(base64.b64decode(value), dtype="<f4")
    return np.asarray(value, np.float32)


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_return_chunks_equals_offline(tiny_server, tiny_encoder, fmt):
    texts = word_texts(5, 1, 60, seed=31)  # up to 4 chunks of 16 tokens
    want = tiny_encoder.encode_documents(texts, return_chunks=True)
    r = tiny_server.post("/v1/embeddings", json={"input": texts, "return_chunks": True, "encoding_format": fmt})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert_close(np.stack([_vector(d["embedding"], fmt) for d in data]), want.documents, atol=1e-5)
    chunks = [c for d in data for c in d["chunks"]]
    assert [len(d["chunks"]) for d in data] == np.bincount(want.chunk_document, minlength=len(texts)).tolist()
    assert_close(np.stack([_vector(c["embedding"], fmt) for c in chunks]), want.chunks, atol=1e-5)
    assert [c["start_char"] for c in chunks] == want.chunk_start_char.tolist()
    assert [c["end_char"] for c in chunks] == want.chunk_end_char.tolist()
    assert [c["tokens"] for c in chunks] == (want.chunk_end - want.chunk_start).tolist()
    plain = tiny_server.post("/v1/embeddings", json={"input": texts}).json()["data"]
    assert "chunks" not in plain[0]


@pytest.mark.parametrize("name", scoring.SCORINGS)
def test_evidence_equals_offline_scoring(tiny_server, tiny_encoder, name):
    texts, query = word_texts(4, 10, 60, seed=32), "the cat sat on a mat"
    out = tiny_encoder.encode_documents(texts, return_chunks=True)
    q = tiny_encoder.encode_queries([query])
    cu = scoring.cu_from_chunk_document(out.chunk_document, len(texts))
    assert not tiny_encoder.normalize_chunks  # raw chunk vectors: the route scores them as unit vectors
    want, evidence = scoring.score(name, q, out.documents, scoring.unit_rows(out.chunks), cu, alpha=0.25)
    r = tiny_server.post("/v1/evidence", json={"query": query, "documents": texts, "scoring": name, "alpha": 0.25})
    assert r.status_code == 200, r.text
    rows = r.json()["data"]
    assert [row["index"] for row in rows] == list(range(len(texts)))
    np.testing.assert_allclose([row["score"] for row in rows], want[0], atol=1e-5)
    assert [row["chunk"] for row in rows] == evidence[0].tolist()
    for d, row in enumerate(rows):
        c = cu[d] + row["chunk"]
        assert (row["start_char"], row["end_char"]) == (out.chunk_start_char[c], out.chunk_end_char[c])
        assert row["text"] == texts[d][row["start_char"] : row["end_char"]]


@pytest.mark.parametrize("body,param", [
    ({"documents": ["a"]}, "query"),
    ({"query": " ", "documents": ["a"]}, "query"),
    ({"query": "q"}, "documents"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": ["a", 3]}, "documents[1]"),
    ({"query": "q", "documents": " "}, "documents"),
    ({"query": "q", "documents": [[1, 2]]}, "documents[0]"),
    ({"query": "q", "documents": ["a"], "scoring": "bm25"}, "scoring"),
    ({"query": "q", "documents": ["a"], "alpha": 2}, "alpha"),
])
def test_bad_evidence_requests_name_the_field(tiny_server, body, param):
    r = tiny_server.post("/v1/evidence", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "input" not in r.json()["error"]["message"].split(";")[0], r.text  # named as this route names it


@pytest.mark.parametrize("body,param,limit", [
    ({"query": word_texts(1, 200, 200, seed=33)[0], "documents": ["a b"]}, "query", "model window"),
    ({"query": "x" * 3300, "documents": ["a b"]}, "query", "max_input_chars"),
    ({"query": "q", "documents": ["a b", "y " * 1700]}, "documents[1]", "max_input_chars"),
    ({"query": "q", "documents": [word_texts(1, 400, 400, seed=34)[0]]}, "documents[0]", "max_tokens_per_document"),
])
def test_evidence_refusals_name_the_query_without_an_index(tiny_server, body, param, limit):
    """``query`` holds one string: a refusal names it ``query``, never ``query[0]``; documents by index."""
    r = tiny_server.post("/v1/evidence", json=body)
    err = r.json()["error"]
    assert r.status_code == 413 and err["param"] == param and limit in err["message"], r.text
    assert err["message"].startswith(f"{param} has "), r.text


def test_bad_return_chunks_is_named(tiny_server):
    for body in ({"input": ["a"], "return_chunks": "yes"}, {"input": ["a"], "return_chunks": True, "input_type": "query"}):
        r = tiny_server.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_chunks", r.text
    r = tiny_server.post("/v1/evidence", json={"query": "q", "documents": ["a"] * 9})  # the route's limits hold
    assert r.status_code == 413


def test_evidence_finds_the_planted_sentence(real_encoder):
    paras = [p for p in prose().split("\n\n") if len(p.split()) > 40][:4]
    docs = [" ".join(paras[i:i + 2]) for i in range(3)]
    docs[1] = docs[1][: len(docs[1]) // 2] + " " + PLANTED + " " + docs[1][len(docs[1]) // 2 :]
    app = create_app(real_encoder)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.post("/v1/evidence", json={"query": "Where is the silver key to the lighthouse?", "documents": docs})
    rows = r.json()["data"]
    best = max(rows, key=lambda row: row["score"])
    assert best["index"] == 1 and PLANTED in best["text"], rows
