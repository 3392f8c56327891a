"""The server client of the LangChain / LlamaIndex adapters (`dice_fast.integrations._embedder`) against a
real uvicorn on 127.0.0.1: 429 and 503 retried after Retry-After, a server not yet listening retried,
transport errors raised as `DiceServerError` within bounded tries and time, and a query over the window
refused alike in-process and through a server (cut, with a warning, by a server started with
--auto-truncate, as the engine does)."""

from __future__ import annotations

import random
import threading
import time
import warnings

import numpy as np
import pytest

from dice_fast.errors import DiceError
from dice_fast.integrations._common import QueryTooLong
from dice_fast.integrations._embedder import LocalEmbedder
from dice_fast.integrations._server_client import DiceServerError, ServerEmbedder, ServerQueryTooLong
from dice_fast.integrations._retry import RetryPolicy, retry_after_seconds
from dice_fast.serve import create_app
from serve_testing import ServerThread

TEXTS = ["a cat sat on the mat", "packed attention keeps every chunk to itself " * 5]


class Refusing:
    """ASGI middleware: answers the first ``refusals`` requests with ``(status, retry_after)`` each in turn
    (or sleeps ``stall`` seconds before answering), then passes requests to the app; counts them all."""

    def __init__(self, app, refusals=(), stall: float = 0.0):
        self.app, self.refusals, self.stall, self.seen = app, list(refusals), stall, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/embeddings":
            return await self.app(scope, receive, send)
        self.seen.append(time.monotonic())
        if self.stall:
            import asyncio

            await asyncio.sleep(self.stall)
        if self.refusals:
            status, after = self.refusals.pop(0)
            headers = [(b"content-type", b"application/json")] + ([(b"retry-after", after.encode())] if after else [])
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "busy, try later"}}'})
            return
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def want(tiny_encoder):
    return tiny_encoder.encode_documents(TEXTS), tiny_encoder.encode_queries(TEXTS)


def test_429_and_503_are_retried_after_retry_after_with_jitter(tiny_encoder, want):
    app = Refusing(create_app(tiny_encoder), [(429, "1"), (503, None), (503, "0")])
    with ServerThread(app) as s:
        client = ServerEmbedder(s.url, max_retries=3)
        np.testing.assert_array_equal(client.documents(TEXTS), want[0])
        gaps = np.diff(app.seen)
        assert len(app.seen) == 4
        assert 1.0 <= gaps[0] < 4.0  # Retry-After: 1, and a little jitter (a busy machine adds the rest)
        assert 0.5 <= gaps[1] < 4.0  # no Retry-After: the backoff's second step, 0.5..1 s
        app.refusals[:] = [(429, "0")] * 3
        with pytest.raises(DiceServerError, match=r"answered 429 for inputs 0\.\.1 of this call \(after 3 tries") as e:
            ServerEmbedder(s.url, max_retries=2).documents(TEXTS)  # retries spent: the 429 is raised
        assert e.value.status == 429
        app.refusals[:] = [(500, None)]
        n = len(app.seen)
        with pytest.raises(DiceServerError, match="answered 500") as e:
            ServerEmbedder(s.url, max_retries=5).documents(TEXTS)  # a server error is not a reason to wait
        assert e.value.status == 500 and len(app.seen) == n + 1
        assert isinstance(e.value, DiceError) and isinstance(e.value, RuntimeError)  # one except for in- and out-of-process


def test_a_server_that_is_not_listening_yet_is_retried_then_reached(tiny_encoder, want):
    server = ServerThread(create_app(tiny_encoder))  # its port is bound, nobody listens: connections are refused
    later = threading.Timer(1.0, server.__enter__)
    later.start()
    try:
        t0 = time.monotonic()
        got = ServerEmbedder(server.url, max_retries=8, max_retry_seconds=30).queries(TEXTS)
        assert time.monotonic() - t0 >= 0.9
        np.testing.assert_array_equal(got, want[1])
    finally:
        later.join()
        server.__exit__(None, None, None)


def test_transport_errors_are_dice_server_errors_within_bounded_tries_and_time(tiny_encoder):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        refused = r"no response from http://127\.0\.0\.1:\d+/v1/embeddings for input 0 of this call \(after 3 tries"
        with pytest.raises(DiceServerError, match=refused + ".*ConnectError") as e:
            ServerEmbedder(url, max_retries=2).documents(["x"])
        assert e.value.status is None and isinstance(e.value.__cause__, Exception)
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        with pytest.raises(DiceServerError, match="no response from"):
            ServerEmbedder(url, max_retries=100, max_retry_seconds=1.5).documents(["x"])  # the time bound ends it
        assert time.monotonic() - t0 < 3.5
    app = Refusing(create_app(tiny_encoder), stall=2.0)
    with ServerThread(app) as s:
        with pytest.raises(DiceServerError, match="ReadTimeout") as e:
            ServerEmbedder(s.url, timeout=0.3, max_retries=3).documents(["x"])
        assert e.value.status is None and len(app.seen) == 1  # the work may still be running: not sent again


def test_the_retry_policy_waits_what_the_server_asks_and_spreads_clients():
    policy = RetryPolicy(max_retries=4, max_retry_seconds=100, rng=random.Random(0))
    waits = [policy.start().wait_after(429, "2") for _ in range(50)]
    assert min(waits) >= 2.0 and max(waits) <= 2.25 and len(set(waits)) == 50  # at least Retry-After, spread
    a = policy.start()
    steps = [a.wait_after(None) for _ in range(5)]
    assert steps[-1] is None and all(0.25 * 2**i <= w <= 0.5 * 2**i for i, w in enumerate(steps[:-1]))
    assert policy.start().wait_after(429, "3600") <= 30.5  # one wait is capped
    assert policy.start().wait_after(200) is None and policy.start().wait_after(413) is None
    assert RetryPolicy(max_retries=3, max_retry_seconds=1).start().wait_after(429, "5") is None  # past the time bound
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and retry_after_seconds("soon") is None
    for bad in (dict(max_retries=-1), dict(max_retries=True), dict(max_retry_seconds=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RetryPolicy(**bad)


def test_a_query_over_the_window_is_refused_alike_in_process_and_through_a_server(tiny_encoder):
    long_query = " ".join(["word"] * 4 * tiny_encoder.window)
    texts = ["short query", long_query]
    with pytest.raises(QueryTooLong, match="query 1 of this call has") as local:
        LocalEmbedder(tiny_encoder).queries(texts)
    with ServerThread(create_app(tiny_encoder)) as s:
        refused = "413 for inputs 0..1 of this call: input.1. has more than .* for a query"
        with pytest.raises(QueryTooLong, match=refused) as served:
            ServerEmbedder(s.url).queries(texts)
    assert isinstance(served.value, ServerQueryTooLong) and isinstance(served.value, DiceServerError)
    assert served.value.status == 413 and served.value.index == local.value.index == 1
    assert served.value.param == "input[1]" and isinstance(served.value, DiceError)
    with ServerThread(create_app(tiny_encoder, auto_truncate=True)) as s:  # the operator's choice: cut, as offline
        with pytest.warns(UserWarning, match="1 queries longer than the model window were cut.*query 1 of this call"):
            got = ServerEmbedder(s.url).queries(texts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_array_equal(got, tiny_encoder.encode_queries(texts))
