"""The front door of the real server (uvicorn on a loopback port): the API key, the body limit counted as
it streams in, the character limit before tokenizing, tokenization that refuses midway, over-long queries
(refused, or cut with --auto-truncate) and positions="global" documents, each a 4xx naming the culprit."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import warnings

import httpx
import pytest

from dice_fast import DiceEncoder
from dice_fast.serve import AsyncDiceEncoder, create_app
from dice_fast.serve.cli import api_key
from dice_fast.serve.errors import InvalidRequest
from helpers import CountingTokenizer, assert_close
from serve_testing import ProxyEncoder, ServerThread, embeddings_of, wait_until, word_texts
from tiny_models import WORDS, tiny

KEY = "sk-dice-test-0123456789"


def raw_request(port: int, headers: dict, body_parts=(), path: str = "/v1/embeddings", method: str = "POST"):
    """Send a request head (and ``body_parts``, which need not complete the body) on a raw socket and read
    the response -> (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(head.encode() + b"\r\n")
        for part in body_parts:
            sock.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        while len(body) < int(fields.get("content-length", 0)) and (chunk := sock.recv(65536)):
            body += chunk
    return int(lines[0].split()[1]), fields, body


def test_api_key_guards_every_route_but_health(tiny_encoder):
    texts = word_texts(3, 3, 30, seed=30)
    ref = tiny_encoder.encode_documents(texts)
    with ServerThread(create_app(tiny_encoder, api_key=KEY)) as server, httpx.Client(base_url=server.url) as http:
        r = http.post("/v1/embeddings", json={"input": texts})
        assert r.status_code == 401 and r.headers["www-authenticate"] == 'Bearer realm="dice-fast"'
        assert r.json()["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in r.json()["error"]["message"]
        for auth in ("Bearer wrong", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", KEY, "Basic c2stZGljZQ==", "Bearer"):
            r = http.post("/v1/embeddings", json={"input": texts}, headers={"Authorization": auth})
            assert r.status_code == 401, auth
            assert 'error="invalid_token"' in r.headers["www-authenticate"]
        good = {"Authorization": f"bearer  {KEY}"}  # the scheme is case-insensitive
        for path in ("/metrics", "/v1/models", "/openapi.json", "/v1/no-such-route"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers=good).status_code == (404 if "no-such" in path else 200), path
        for page in ("/docs", "/redoc"):  # a browser page cannot send the key: off
            assert http.get(page, headers=good).status_code == 404
        assert http.get("/health").status_code == 200
        r = http.post("/v1/embeddings", json={"input": texts}, headers=good)
        assert r.status_code == 200
        assert_close(embeddings_of(r.json()), ref, atol=1e-5)
        # refused before the body is read: a 64 MiB upload announced, none of it sent
        status, fields, _ = raw_request(server.port, {"Content-Length": str(64 << 20), "Content-Type": "application/json"})
        assert status == 401 and fields["www-authenticate"].startswith("Bearer")
        # every 401 above is counted by reason, on the guarded /metrics
        text = http.get("/metrics", headers=good).text
        assert 'dice_fast_unauthorized_total{reason="missing"} 6' in text  # 1 post, 4 gets, 1 raw
        assert 'dice_fast_unauthorized_total{reason="invalid"} 6' in text


def test_the_openai_client_sends_the_key(tiny_encoder):
    openai = pytest.importorskip("openai")
    texts = word_texts(3, 3, 30, seed=32)
    with ServerThread(create_app(tiny_encoder, api_key=KEY)) as server:
        out = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).embeddings.create(
            input=texts, model="tiny")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).embeddings.create(
                input=texts, model="tiny")
    assert_close(embeddings_of(out.model_dump()), tiny_encoder.encode_documents(texts), atol=1e-5)


def test_api_key_of_a_mounted_app(tiny_encoder):
    from starlette.applications import Starlette
    from starlette.routing import Mount

    core = AsyncDiceEncoder(tiny_encoder)
    parent = Starlette(routes=[Mount("/embed", create_app(core, api_key=KEY))])
    with ServerThread(parent) as server, httpx.Client(base_url=server.url + "/embed") as http:
        wait_until(lambda: http.get("/health").status_code == 200, what="the mounted app's warm-up")
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    core.close()
    with pytest.raises(ValueError, match="visible ASCII"):
        create_app(core, api_key="two words")


def test_api_key_sources(tmp_path):
    def args(**kw):
        return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})

    env = {"DICE_FAST_API_KEY": "from-env"}
    assert api_key(args(), environ={}) is None
    assert api_key(args(), environ=env) == "from-env"
    assert api_key(args(api_key="from-flag"), environ=env) == "from-flag"
    (tmp_path / "key").write_text("from-file\n")
    assert api_key(args(api_key_file=str(tmp_path / "key")), environ=env) == "from-file"
    (tmp_path / "empty").write_text("\n")
    for bad, environ, match in ((args(), {"DICE_FAST_API_KEY": ""}, r"\$DICE_FAST_API_KEY"),
                                (args(api_key="has space"), {}, "--api-key"),
                                (args(api_key_file=str(tmp_path / "empty")), {}, "--api-key-file"),
                                (args(api_key="a", api_key_file=str(tmp_path / "key")), {}, "not both")):
        with pytest.raises(ValueError, match=match):  # given but unusable: never an open server
            api_key(bad, environ=environ)
    # the flag wins over the variable: --api-key beside $DICE_FAST_API_KEY_FILE (the file flag's default
    # then) was refused as "not both"
    from_file = {"DICE_FAST_API_KEY_FILE": str(tmp_path / "key")}
    assert api_key(args(api_key="from-flag", api_key_file=str(tmp_path / "key")), environ=from_file) == "from-flag"


def test_body_limit_is_enforced_while_the_body_streams_in(tiny_encoder):
    limit = 100_000
    text = word_texts(1, 5, 10, seed=31)[0]
    with ServerThread(create_app(tiny_encoder, max_body_bytes=limit)) as server:
        # announced too large: 413 at once, nothing of the body sent
        status, _, body = raw_request(server.port, {"Content-Length": str(64 << 20), "Content-Type": "application/json"})
        assert status == 413 and "max_body_bytes" in json.loads(body)["error"]["message"]
        # chunked, no length announced: refused once the bytes received pass the limit, the rest never sent
        prefix = b'{"input": "' + b"word " * 1000
        chunks = [b"%x\r\n%s\r\n" % (len(prefix), prefix)] * (limit // len(prefix) + 2)
        status, _, body = raw_request(server.port, {"Transfer-Encoding": "chunked", "Content-Type": "application/json"},
                                      chunks)
        assert status == 413 and "more than 100000 bytes" in json.loads(body)["error"]["message"]
        # a body of exactly the limit is read and answered
        exact = json.dumps({"input": text}).encode()
        exact = exact[:-1] + b" " * (limit - len(exact)) + b"}"
        r = httpx.post(server.url + "/v1/embeddings", content=exact, headers={"Content-Type": "application/json"})
        assert r.status_code == 200
        assert_close(embeddings_of(r.json()), tiny_encoder.encode_documents([text]), atol=1e-5)
        # an upload left open half-way holds up nobody
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as slow:
            slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 90000\r\n\r\n" + prefix)
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            r = httpx.post(server.url + "/v1/embeddings", json={"input": [text]}, timeout=30)
            assert r.status_code == 200


JSON = {"Content-Type": "application/json"}


def test_huge_inputs_are_refused_before_costing_their_tokenization(tiny_encoder, monkeypatch):
    """12 MB of text: refused by the character limit without a tokenizer call; with that limit lifted,
    after a few pieces, as soon as the tokens found pass the queue (tiny: 8,192 tokens)."""
    big = " ".join(WORDS * 55_000)  # ~12.5 MB, ~2.7 M tokens
    assert len(big) > 12_000_000
    proxy = ProxyEncoder(tiny_encoder)
    body = json.dumps({"input": ["short", big]}).encode()

    counting = CountingTokenizer(tiny_encoder.engine_tokenizer)
    monkeypatch.setattr(tiny_encoder, "engine_tokenizer", counting)  # the engine tokenizes through its own copy

    @contextlib.contextmanager
    def serve(**limits):
        with ServerThread(create_app(proxy, max_body_bytes=64 << 20, **limits)) as server:
            server.wait_ready()
            counting.calls = 0  # counts the calls of requests only (not the warm-up's)
            yield server

    with serve() as server:
        r = httpx.post(server.url + "/v1/embeddings", content=body, timeout=60, headers=JSON)
        assert r.status_code == 413 and r.json()["error"]["param"] == "input[1]"
        assert "max_input_chars" in r.json()["error"]["message"] and counting.calls == 0
    with serve(max_input_chars=10**8) as server:
        r = httpx.post(server.url + "/v1/embeddings", content=body, timeout=60, headers=JSON)
        assert r.status_code == 413 and "max_queue_tokens" in r.json()["error"]["message"]
        calls = counting.calls
        assert calls <= 4, f"{calls} tokenizer calls for a request refused after the first pieces"
    with serve(max_input_chars=10**8, max_tokens_per_document=500) as server:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": ["short", big[:200_000]]}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["param"] == "input[1]"
        assert "more than 500 tokens" in r.json()["error"]["message"] and counting.calls <= 3
        r = httpx.post(server.url + "/v1/embeddings", json={"input": ["short", "a bit longer"]}, timeout=60)
        assert r.status_code == 200


@pytest.mark.filterwarnings("ignore:.*longer than the model window")
def test_long_queries_are_refused_or_cut_with_auto_truncate(tiny_encoder):
    texts = ["a short query", " ".join(WORDS * 4)]  # ~200 tokens: over the 126 a query window holds
    ref = tiny_encoder.encode_queries(texts)
    with ServerThread(create_app(tiny_encoder)) as server:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": texts, "input_type": "query"}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["param"] == "input[1]"
        assert "auto-truncate" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/embeddings", json={"input": texts}, timeout=60)  # as documents: chunked
        assert r.status_code == 200 and "truncated_inputs" not in r.json()["usage"]
    with ServerThread(create_app(tiny_encoder, auto_truncate=True)) as server:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": texts, "input_type": "query"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["truncated_inputs"] == [1]
    assert r.json()["usage"]["prompt_tokens"] == int(tiny_encoder.plan(texts, "queries").document_tokens.sum())
    assert_close(embeddings_of(r.json()), ref, atol=1e-5)


def test_global_positions_past_the_model_is_413_naming_the_input():
    model, tokenizer, *_ = tiny("bert")
    encoder = DiceEncoder(model, tokenizer, chunk_size=16, positions="global", max_batch_tokens=128)
    texts = ["a short one", " ".join(WORDS * 3)]  # ~150 tokens: positions past the model's 128
    with ServerThread(create_app(encoder)) as server:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": texts}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["param"] == "input[1]"
        assert "positions='global'" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/embeddings", json={"input": texts[:1]}, timeout=60)
    assert r.status_code == 200
    assert_close(embeddings_of(r.json()), encoder.encode_documents(texts[:1]), atol=1e-5)


def test_core_names_a_text_that_is_not_unicode(tiny_encoder):
    async def main():
        async with AsyncDiceEncoder(tiny_encoder) as core:
            with pytest.raises(InvalidRequest, match=r"input\[1\] is not valid Unicode") as e:
                await core.embed_documents(["fine", "bad \udc80"])
            assert e.value.param == "input[1]"
            return await core.embed_documents(["fine"])

    out = asyncio.run(asyncio.wait_for(main(), 60))
    assert_close(out.vectors, tiny_encoder.encode_documents(["fine"]), atol=1e-5)


def test_max_tokens_used_is_what_the_plan_covers(tiny_encoder):
    model, tokenizer, *_ = tiny("bert")
    capped = DiceEncoder(model, tokenizer, chunk_size=16, overlap=4, max_chunks_per_document=3)
    for encoder, kind in ((tiny_encoder, "queries"), (tiny_encoder, "documents"), (capped, "documents")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the query cut to the window
            plan = encoder.plan([" ".join(WORDS * 5)], kind)
        covered = int(plan.chunks.start[-1] + plan.chunks.length[-1])
        used = encoder.max_tokens_used(kind)
        assert (used is None and covered == plan.tokens.lengths[0]) or used == covered < plan.tokens.lengths[0]
    assert capped.max_tokens_used("documents") == 16 + 2 * 12
