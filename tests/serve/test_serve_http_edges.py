"""HTTP/1.1 at the byte level, against a real uvicorn on 127.0.0.1 (raw sockets): a head framed by both
Content-Length and Transfer-Encoding closes its connection (no smuggled second request is answered); a
POST no route takes closes instead of being read whole; a pipelined request is not cut off by the read
timeout while it waits its turn; HEAD is answered wherever GET is; a request h11 cannot parse gets
OpenAI's error shape; a compressed body is refused, not misread."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

from dice_fast import DiceEncoder
from dice_fast.serve import create_app
from serve_testing import ProxyEncoder, ServerThread
from tiny_models import tiny

HEAD = b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
BODY = b'{"input": ["the cat sat on a mat"]}'


@pytest.fixture(scope="module")
def held():
    model, tok, *_ = tiny("bert")
    return ProxyEncoder(DiceEncoder(model, tok, chunk_size=16, max_batch_tokens=128))


@pytest.fixture(scope="module")
def server(held):
    app = create_app(held, max_body_bytes=100_000, allowed_hosts=["127.0.0.1"])
    with ServerThread(app, read_timeout=1.0) as s:
        yield s.wait_ready()  # a test that holds the forward back may not catch the warm-up behind it


def exchange(port: int, data: bytes, seconds: float = 10.0) -> tuple[list[bytes], bool]:
    """Send ``data`` in one write; the status lines of the responses read, and whether the server closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as sock:
        sock.sendall(data)
        got, deadline, closed = b"", time.monotonic() + seconds, False
        sock.settimeout(0.3)
        while time.monotonic() < deadline:
            try:
                part = sock.recv(1 << 16)
            except socket.timeout:
                if got.count(b"HTTP/1.1 ") >= data.count(b" HTTP/1.1\r\n"):
                    break
                continue
            if not part:
                closed = True
                break
            got += part
    return re.findall(rb"HTTP/1\.1 \d{3} [^\r]*", got), closed  # a body ends without CRLF: not split by lines


def test_content_length_and_transfer_encoding_together_close_the_connection(server):
    """RFC 9112 6.1: the server MUST close after answering; a proxy framing by the length sees one
    request where this server saw two, and the second (smuggled) one was answered."""
    smuggled = b"GET /v1/models?smuggled=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    request = (b"POST /v1/embeddings HTTP/1.1\r\n" + HEAD + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"0\r\n\r\n" % (5 + len(smuggled)))
    statuses, closed = exchange(server.port, request + smuggled)
    assert len(statuses) == 1 and closed, statuses


@pytest.mark.parametrize("path", ["/v1/nothing", "/health", "/v1/embeddings/"])
def test_a_post_no_route_takes_closes_its_connection_unread(server, path):
    """404, 405 and the trailing-slash redirect kept the connection open and read a chunked body
    whole (3.5 GB in 3 s on loopback) until the read timeout."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\n%sTransfer-Encoding: chunked\r\n\r\n" % (path.encode(), HEAD))
        sent, answer = 0, b""
        sock.settimeout(0.05)
        try:
            while sent < 200 << 20 and b"\r\n\r\n" not in answer:
                sock.sendall(b"10000\r\n" + b"x" * 65536 + b"\r\n")
                sent += 65536
                try:
                    answer += sock.recv(4096)
                except socket.timeout:
                    pass
        except (BrokenPipeError, ConnectionResetError):
            pass
    status = answer.split(b"\r\n", 1)[0]
    assert status in (b"HTTP/1.1 404 Not Found", b"HTTP/1.1 405 Method Not Allowed"), answer[:200]
    assert b"connection: close" in answer.lower() and sent < 100 << 20, (sent, answer[:300])


def test_a_pipelined_request_is_not_cut_off_while_it_waits(server, held):
    """The read timer (1 s here) was armed again after the first response although the next request
    had arrived with it: that request's forward (held 2 s) lost its answer, the connection closed."""
    held.gate.clear()
    try:
        request = b"POST /v1/embeddings HTTP/1.1\r\n" + HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
        pipelined = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + request
        threading.Timer(2.0, held.gate.set).start()
        statuses, _ = exchange(server.port, pipelined, seconds=15)
    finally:
        held.gate.set()
    assert statuses == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"], statuses


def test_head_parse_errors_and_compressed_bodies(server):
    for path in (b"/health", b"/v1/models", b"/metrics"):  # RFC 9110 9.1: GET and HEAD (it was 405)
        statuses, _ = exchange(server.port, b"HEAD %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % path)
        assert statuses == [b"HTTP/1.1 200 OK"], (path, statuses)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # no Host: h11 refuses it
        sock.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        answer = b""
        while part := sock.recv(1 << 16):
            answer += part
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), head
    assert b"date: " in head.lower() and b"content-length: %d" % len(body) in head.lower(), head
    assert b'"code": "bad_http_request"' in body, body
    gzip = (b"POST /v1/embeddings HTTP/1.1\r\n" + HEAD + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
            % (len(BODY), BODY))  # plain bytes labelled gzip were embedded; real gzip said "not UTF-8"
    statuses, closed = exchange(server.port, gzip)
    assert statuses == [b"HTTP/1.1 415 Unsupported Media Type"], statuses


def test_an_absolute_form_target_is_read_as_its_path(server):
    """RFC 9112 3.2.2: a server MUST accept a target in absolute form; uvicorn's h11 protocol left the
    whole URL as the path, and every route answered 404. Its authority replaces the Host header, so the
    Host check judges the name the request gave."""
    post = b"POST http://127.0.0.1:%d/v1/embeddings HTTP/1.1\r\n" % server.port
    statuses, _ = exchange(server.port, post + HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
    assert statuses == [b"HTTP/1.1 200 OK"], statuses
    for target, want in ((b"HTTP://127.0.0.1/v1/models?limit=1", b"200 OK"), (b"http://127.0.0.1", b"404 Not Found"),
                         (b"http://evil.example/health", b"400 Bad Request")):  # Host: 127.0.0.1 beside it
        statuses, _ = exchange(server.port, b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % target)
        assert statuses == [b"HTTP/1.1 " + want], (target, statuses)


def chunked(pieces: list[bytes]) -> bytes:
    """A POST /v1/embeddings whose body is sent in ``pieces``, as chunks of a chunked body."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return b"POST /v1/embeddings HTTP/1.1\r\n" + HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + body


def test_a_body_in_thousands_of_tiny_pieces_is_refused_early(server):
    """h11 parses each chunk in Python on the event loop: 2 MiB in 1-byte chunks held it ~21 s, stalling
    every other client. Past 4,096 pieces a body must average 32 bytes a piece."""
    from dice_fast.serve.server import MANY_PIECES

    text = BODY[:-3] + b" " * (MANY_PIECES - 100 - len(BODY)) + BODY[-3:]  # the same request, 1-byte pieces
    statuses, _ = exchange(server.port, chunked([bytes([c]) for c in text]))  # under the bound: served
    assert statuses == [b"HTTP/1.1 200 OK"], statuses
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(chunked([b" "] * 50_000))
        answer = b""
        while part := sock.recv(1 << 16):  # the server closes after its answer
            answer += part
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"more than 4096 pieces of 1.0 bytes on average" in answer and b"bad_http_request" in answer, answer
    statuses, _ = exchange(server.port, chunked([BODY[i:i + 32] for i in range(0, len(BODY), 32)]))
    assert statuses == [b"HTTP/1.1 200 OK"], statuses  # the server serves on


def test_the_protocol_is_h11_whatever_is_installed(monkeypatch):
    """With httptools installed uvicorn's "auto" protocol is httptools', which none of the bounds above
    reach (pieces of a body, OpenAI-shaped 400s): the server always runs its h11 protocol."""
    import asyncio

    from uvicorn.protocols.http import auto
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from dice_fast.serve.server import bounded_protocol

    monkeypatch.setattr(auto, "AutoHTTPProtocol", type("HttpToolsProtocol", (asyncio.Protocol,), {}))  # as if installed
    assert issubclass(bounded_protocol(1.0, 1.0), H11Protocol)
