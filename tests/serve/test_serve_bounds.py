"""What a request costs the server, against a real uvicorn on 127.0.0.1: its share is held until its
response is sent (and a client that stops reading is cut off), the response budget refuses before any
work, one evidence request is one request, an oversize chunked upload is cut at the limit, and idle,
dripping or slow connections are closed by the read timeout; the connection limit holds."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from dice_fast.serve import AsyncDiceEncoder, create_app
from dice_fast.serve.errors import DeadlineExceeded
from helpers import CountingTokenizer, assert_close
from serve_testing import ProxyEncoder, ServerThread, embeddings_of, wait_until, word_texts

JSON = {"Content-Type": "application/json"}


def post_unread(port: int, body: bytes) -> socket.socket:
    """A raw connection that sends ``body`` to /v1/embeddings and never reads (a tiny receive buffer)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` within ``seconds`` (reading and dropping what it sends)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if not sock.recv(1 << 16):
                return True
        except socket.timeout:
            continue
        except OSError:  # reset
            return True
    return False


def test_a_request_holds_its_share_until_its_response_is_sent(tiny_encoder):
    """20,000 one-word inputs: ~13 MB of float JSON from a 120 kB request. While the client does not read,
    the request stays in flight with its tokens held (a second request: 429), until the write timeout
    aborts the connection; a client that reads gets every byte."""
    n = 20_000
    body = json.dumps({"input": ["word"] * n}).encode()
    app = create_app(tiny_encoder, max_inputs_per_request=n, max_concurrent_requests=1, max_queue_tokens=10**6)
    with ServerThread(app, write_timeout=1.5) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        server.wait_ready()
        core = app.state.core
        sock = post_unread(server.port, body)
        try:
            wait_until(lambda: core.tokens_held > 0 and core.tokens_waiting == 0, what="the vectors, unsent")
            time.sleep(0.5)  # well past the serialisation: the response is stuck in the unread connection
            assert core.requests_in_flight == 1 and core.tokens_held == 3 * n
            r = http.post("/v1/embeddings", json={"input": "another"})
            assert r.status_code == 429 and "max_concurrent_requests" in r.json()["error"]["message"]
            wait_until(lambda: core.requests_in_flight == 0, timeout=20, what="the write timeout to end it")
            assert core.tokens_held == 0 and closed_within(sock, 5)
        finally:
            sock.close()
        r = http.post("/v1/embeddings", content=body, headers=JSON)
        assert r.status_code == 200 and len(r.content) > 50 * len(body)
        assert_close(embeddings_of(r.json())[[0, -1]], tiny_encoder.encode_documents(["word"] * 2), atol=1e-5)
        assert core.requests_in_flight == 0


def test_the_response_budget_refuses_before_any_work(tiny_encoder, monkeypatch):
    proxy = ProxyEncoder(tiny_encoder)  # 32 floats per vector
    long_doc = word_texts(1, 800, 800, seed=50)[0]  # 50 chunks
    with ServerThread(create_app(proxy, max_response_floats=1000)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        server.wait_ready()
        ran, counting = len(proxy.batches), CountingTokenizer(tiny_encoder.engine_tokenizer)
        monkeypatch.setattr(tiny_encoder, "engine_tokenizer", counting)  # the engine tokenizes through its own copy
        r = http.post("/v1/embeddings", json={"input": ["word"] * 40})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        msg = r.json()["error"]["message"]
        assert "(40 inputs) x 32 floats = 1280 floats" in msg and "1000 (max_response_floats)" in msg
        assert counting.calls == 0
        r = http.post("/v1/embeddings", json={"input": [long_doc], "return_chunks": True})
        assert r.status_code == 413 and "(1 inputs + 50 chunks) x 32 floats" in r.json()["error"]["message"]
        assert len(proxy.batches) == ran, "a refused response ran a forward"
        r = http.post("/v1/embeddings", json={"input": ["word"] * 40, "dimensions": 16})  # 640 floats
        assert r.status_code == 200 and embeddings_of(r.json()).shape == (40, 16)


def test_evidence_is_charged_for_its_rows_not_for_the_chunk_vectors_it_scores(tiny_encoder, monkeypatch):
    """/v1/evidence returns a row per document and no vectors: the chunk vectors it scores with are not
    response floats (a document of 25 chunks passes a budget of 10 vectors), its rows are (6 numbers
    each: a 413 naming ``documents``, before any tokenizing), and its other limits still hold."""
    proxy = ProxyEncoder(tiny_encoder)  # 32 floats per vector
    doc = word_texts(1, 400, 400, seed=54)[0]  # 25 chunks, 450 tokens with [CLS]/[SEP]
    app = create_app(proxy, max_response_floats=32 * 10, max_inputs_per_request=60, max_tokens_per_document=500,
                     max_queue_tokens=1000)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        server.wait_ready()
        r = http.post("/v1/embeddings", json={"input": [doc], "return_chunks": True})  # chunk vectors returned
        assert r.status_code == 413 and "(1 inputs + 25 chunks) x 32 floats" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "input"
        r = http.post("/v1/evidence", json={"query": "word another", "documents": [doc, "the cat"]})
        assert r.status_code == 200, r.text
        assert [row["index"] for row in r.json()["data"]] == [0, 1] and r.json()["data"][0]["text"] in doc

        ran, counting = len(proxy.batches), CountingTokenizer(tiny_encoder.engine_tokenizer)
        monkeypatch.setattr(tiny_encoder, "engine_tokenizer", counting)  # the engine tokenizes through its own copy
        r = http.post("/v1/evidence", json={"query": "word", "documents": ["the cat"] * 54})  # 324 numbers
        err = r.json()["error"]
        assert r.status_code == 413 and err["param"] == "documents" and err["code"] == "request_too_large", r.text
        assert "54 documents x 6 numbers = 324 floats" in err["message"] and "in 'documents'" in err["message"]
        assert "return_chunks" not in err["message"]  # the route has no such field
        assert counting.calls == 0 and len(proxy.batches) == ran
        monkeypatch.undo()
        # bounded by its other limits: inputs, tokens per document, tokens per request
        refusals = [({"query": "q", "documents": ["the cat"] * 61}, "documents", "max_inputs_per_request"),
                    ({"query": "q", "documents": [doc + " " + doc]}, "documents[0]", "max_tokens_per_document"),
                    ({"query": "q", "documents": [doc] * 3}, "documents", "max_queue_tokens")]
        for body, param, limit in refusals:
            r = http.post("/v1/evidence", json=body)
            assert r.status_code == 413 and r.json()["error"]["param"] == param, r.text
            assert limit in r.json()["error"]["message"], r.text
        assert len(proxy.batches) == ran, "a refused request ran a forward"
        assert app.state.core.requests_in_flight == 0 and app.state.core.tokens_held == 0


def test_one_evidence_request_is_one_request(tiny_encoder, monkeypatch):
    """With one request at a time allowed, /v1/evidence is served; a query refused (over the window)
    is refused before its documents are tokenized or run."""
    proxy = ProxyEncoder(tiny_encoder)
    docs = word_texts(3, 100, 200, seed=51)
    app = create_app(proxy, max_concurrent_requests=1, max_tokens_per_document=400)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        server.wait_ready()
        r = http.post("/v1/evidence", json={"query": "word another", "documents": docs})
        assert r.status_code == 200, r.text
        assert [row["index"] for row in r.json()["data"]] == [0, 1, 2]
        ran, counting = len(proxy.batches), CountingTokenizer(tiny_encoder.engine_tokenizer)
        monkeypatch.setattr(tiny_encoder, "engine_tokenizer", counting)  # the engine tokenizes through its own copy
        long_query = word_texts(1, 300, 300, seed=52)[0]
        r = http.post("/v1/evidence", json={"query": long_query, "documents": docs})
        assert r.status_code == 413 and r.json()["error"]["param"] == "query"  # one string: no index
        assert len(proxy.batches) == ran, "the refused request's documents ran"
        assert counting.calls == 1, "the documents of a refused query were tokenized"
        assert app.state.core.requests_in_flight == 0 and app.state.core.tokens_held == 0


def test_the_first_failure_of_an_evidence_call_cancels_the_rest(tiny_encoder):
    """Past its deadline, a query-and-documents call drops the documents' chunks that have not run."""
    proxy = ProxyEncoder(tiny_encoder)
    docs = word_texts(2, 400, 400, seed=53)  # 50 chunks of 18 tokens: 8 batches of 128

    async def main():
        async with AsyncDiceEncoder(proxy, request_timeout=0.5) as core:
            proxy.gate.clear()
            with pytest.raises(DeadlineExceeded):
                await core.embed_query_and_documents(["word"], docs, return_chunks=True)
            proxy.gate.set()
            for _ in range(100):
                if core.tokens_waiting == 0 and core.requests_in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            return core.tokens_waiting, core.requests_in_flight

    assert asyncio.run(asyncio.wait_for(main(), 60)) == (0, 0)
    assert sum(proxy.batches) <= tiny_encoder.max_batch_tokens, "chunks of the cancelled call ran on"


def test_an_oversize_chunked_upload_is_cut_at_the_limit(tiny_encoder):
    limit, piece = 100_000, 1 << 16
    chunk = b"%x\r\n%s\r\n" % (piece, b" " * piece)
    with ServerThread(create_app(tiny_encoder, max_body_bytes=limit)) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        sent = 0
        try:
            for _ in range(400):  # up to 26 MB, as fast as the server takes it
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server closed the connection after its 413
            pass
        data = b""
        try:
            while chunk_in := sock.recv(1 << 16):
                data += chunk_in
        except OSError:
            pass
        sock.close()
        read = server.protocol.bytes_received
    assert data.startswith(b"HTTP/1.1 413") or sent < 400 * len(chunk), data[:200]
    assert b"connection: close" in data.lower() or not data
    # the limit, plus what one socket read brings in (asyncio reads up to 256 KiB at a time), plus framing
    most = limit + (1 << 18) + piece
    assert read <= most, f"the server read {read} bytes of a chunked upload over a {limit}-byte limit"


def test_idle_dripping_and_slow_connections_are_closed(tiny_encoder):
    with ServerThread(create_app(tiny_encoder, read_timeout=1.0), read_timeout=1.0) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(16)]
        drip = socket.create_connection(("127.0.0.1", server.port))
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"input\": ")
        start, line = time.monotonic(), b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Drip: " + b"a" * 40
        for i in range(len(line)):  # one byte every 0.1 s: never a complete head
            try:
                drip.sendall(line[i:i + 1])
            except OSError:
                break
            time.sleep(0.1)
        assert closed_within(drip, 2) and time.monotonic() - start < 4
        assert all(closed_within(s, 2) for s in idle)
        slow.settimeout(5)
        reply = slow.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        for s in idle + [drip, slow]:
            s.close()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_the_connection_limit_refuses_more(tiny_encoder):
    with ServerThread(create_app(tiny_encoder), max_connections=4) as server:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        time.sleep(0.2)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        for s in held:
            s.close()
        wait_until(lambda: httpx.get(server.url + "/health", timeout=10).status_code == 200, timeout=10,
                   what="connections to free up")


def test_a_client_still_sending_an_oversize_body_reads_its_413(tiny_encoder):
    """The 413 comes before the body is read; closing at once would reset a client still writing it
    (its kernel drops the unread 413). The server lingers: it half-closes, drops what still comes, and
    closes when the client has finished or the linger bound has passed."""
    limit = 1 << 20
    body = b'{"input": "' + b"a" * limit + b'"}'

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async def one():
                try:
                    return (await http.post("/v1/embeddings", content=body, headers=JSON)).status_code
                except httpx.TransportError as exc:  # before the linger: ReadError on about half
                    return type(exc).__name__

            return [status for _ in range(4) for status in await asyncio.gather(*(one() for _ in range(8)))]

    with ServerThread(create_app(tiny_encoder, max_body_bytes=limit)) as server:
        statuses = asyncio.run(main(server.url))
    assert statuses == [413] * 32, statuses


def test_the_linger_after_an_early_413_is_bounded(tiny_encoder):
    from dice_fast.serve.server import LINGER_BYTES, LINGER_SECONDS

    limit = 100_000
    with ServerThread(create_app(tiny_encoder, max_body_bytes=limit)) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 900000000\r\n\r\n")
        start, sent, piece = time.monotonic(), 0, b" " * (1 << 16)
        try:  # a client that never stops sending is cut off by the linger's bounds
            while time.monotonic() - start < LINGER_SECONDS + 10:
                sock.sendall(piece)
                sent += len(piece)
        except OSError:
            pass
        took = time.monotonic() - start
        sock.close()
    assert took < LINGER_SECONDS + 5, f"the server kept reading for {took:.1f} s"
    assert server.protocol.bytes_discarded <= LINGER_BYTES + (1 << 18), server.protocol.bytes_discarded
