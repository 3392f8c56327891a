"""Malformed and random bodies against a real server (uvicorn on 127.0.0.1): every one gets a 4xx in
OpenAI's error shape naming the culprit, never a 5xx, and nothing reaches the log as an error; the
server answers correctly afterwards. Random bodies come from hypothesis (bounded: few examples)."""

from __future__ import annotations

import json
import logging

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dice_fast.serve import create_app
from helpers import assert_close
from serve_testing import ServerThread, embeddings_of, word_texts
from tiny_models import WORDS

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Errors(logging.Handler):
    """Keeps every log record of level ERROR or above."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def server(tiny_encoder):
    app = create_app(tiny_encoder, max_body_bytes=1 << 20, max_inputs_per_request=8)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        errors = Errors()
        watched = [logging.getLogger(), logging.getLogger("uvicorn")]  # uvicorn's loggers do not propagate
        for logger in watched:
            logger.addHandler(errors)
        http.errors = errors
        yield http
        for logger in watched:
            logger.removeHandler(errors)


def check_answer(r: httpx.Response, n_inputs: int | None = None) -> None:
    """A 200 with one finite vector per input, or a 4xx with OpenAI's error shape; never a 5xx."""
    assert r.status_code < 500, r.text
    body = r.json()
    if r.status_code == 200:
        vectors = embeddings_of(body)
        assert np.isfinite(vectors).all() and (n_inputs is None or len(vectors) == n_inputs)
    else:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and len(err["message"]) < 600


NESTED = b"[" * 100_000 + b"]" * 100_000
MALFORMED = [  # (body, content type, status, param)
    (b'{"input": ' + NESTED + b"}", "application/json", 400, None),
    (NESTED, "application/json", 400, None),
    (b'{"input": "lone \\ud800 surrogate"}', "application/json", 400, "input"),
    (b'{"input": ["ok", "x\\udfff"]}', "application/json", 400, "input[1]"),
    (b'{"input": "a", "dimensions": NaN}', "application/json", 400, None),
    (b'{"input": "a", "dimensions": -Infinity}', "application/json", 400, None),
    (b'{"input": "a", "dimensions": 1e999}', "application/json", 400, "dimensions"),
    (b'{"input": "a", "dimensions": 1' + b"0" * 5000 + b"}", "application/json", 400, None),
    (b'{"input": "a", "input": "b"}', "application/json", 400, "input"),
    (b'{"input": "a", "encoding_format": "' + b"x" * 100_000 + b'"}', "application/json", 400, "encoding_format"),
    (b'{"input": [{"text": "a"}]}', "application/json", 400, "input[0]"),
    (b'{"input": ["a", [1, 2]]}', "application/json", 400, "input[1]"),
    (b"", "application/json", 400, None),
    (b"   \n", "application/json", 400, None),
    (b"{\"input\": \"a\"}", None, 415, None),
    (b"\xff\xfe\x00", "application/json", 400, None),
    (b'{"input": "a"}', "text/plain", 415, None),
    (b"input=a", "application/x-www-form-urlencoded", 415, None),
    (b'{"input": "a"}', "application/json; charset=latin-1", 415, None),
    (b'{"input": "a"}' + b" " * (1 << 20), "application/json", 413, None),
]


def test_malformed_bodies_get_4xx_naming_the_culprit(server):
    for body, content_type, status, param in MALFORMED:
        headers = {"Content-Type": content_type} if content_type else {}
        r = server.post("/v1/embeddings", content=body, headers=headers)
        assert r.status_code == status, (body[:80], r.text[:300])
        check_answer(r)
        assert r.json()["error"]["param"] == param, (body[:80], r.json())
    for ok_type in ("application/json; charset=UTF-8", "application/vnd.api+json"):
        r = server.post("/v1/embeddings", content=b'{"input": "a b"}', headers={"Content-Type": ok_type})
        assert r.status_code == 200, (ok_type, r.text)
    r = server.post("/v1/embeddings", content=b'{"input": "a b"}')  # a body must be declared JSON
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]


def text_with_surrogates():
    """Mostly the tiny vocabulary's words, sometimes any character, a lone surrogate or nothing."""
    piece = st.one_of(st.sampled_from(WORDS), st.characters(), st.integers(0xD800, 0xDFFF).map(chr), st.just(" "))
    return st.lists(piece, max_size=30).map(" ".join)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
REQUESTS = st.fixed_dictionaries(
    {"input": st.one_of(text_with_surrogates(), st.lists(text_with_surrogates(), max_size=10), JSON_VALUES)},
    optional={"encoding_format": st.one_of(st.sampled_from(["float", "base64"]), JSON_VALUES),
              "input_type": st.one_of(st.sampled_from(["document", "query", "search_query"]), JSON_VALUES),
              "dimensions": st.one_of(st.just(32), JSON_VALUES), "model": JSON_VALUES, "user": JSON_VALUES},
)


def n_inputs(request: dict):
    x = request.get("input")
    return 1 if isinstance(x, str) else len(x) if isinstance(x, list) else None


@FUZZ
@given(request=REQUESTS)
def test_random_requests_never_get_a_5xx(server, request):
    r = server.post("/v1/embeddings", content=json.dumps(request).encode(), headers={"Content-Type": "application/json"})
    check_answer(r, n_inputs(request))


@FUZZ
@given(request=REQUESTS, edits=st.lists(st.tuples(st.integers(0, 10**6), st.binary(max_size=3)), min_size=1,
                                        max_size=4), cut=st.integers(0, 10**6))
def test_mangled_bodies_never_get_a_5xx(server, request, edits, cut):
    body = bytearray(json.dumps(request).encode())
    for at, insert in edits:  # overwrite or insert a few bytes anywhere, then maybe cut the end off
        at %= len(body) + 1
        body[at : at + (len(insert) if at % 2 else 0)] = insert
    r = server.post("/v1/embeddings", content=bytes(body[: max(1, cut % (len(body) + 8))]),
                    headers={"Content-Type": "application/json"})
    check_answer(r)


@FUZZ
@given(body=st.binary(max_size=300), content_type=st.sampled_from([None, "application/json", "text/plain", "", ";;"]))
def test_random_bytes_never_get_a_5xx(server, body, content_type):
    r = server.post("/v1/embeddings", content=body, headers={"Content-Type": content_type} if content_type is not None
                    else {})
    check_answer(r)


def test_the_server_is_still_correct_and_logged_no_error(server, tiny_encoder):
    """Runs after the fuzzing above (pytest keeps the file's order)."""
    texts = word_texts(5, 1, 60, seed=40)
    for kind, ref in (("document", tiny_encoder.encode_documents(texts)), ("query", tiny_encoder.encode_queries(texts))):
        r = server.post("/v1/embeddings", json={"input": texts, "input_type": kind, "encoding_format": "base64"})
        assert r.status_code == 200
        assert_close(embeddings_of(r.json()), ref, atol=1e-5, what=kind)
    assert 'status="500"' not in server.get("/metrics").text
    assert not server.errors.records, [r.getMessage() for r in server.errors.records[:3]]
