"""The adapters' server client against a scripted HTTP server (the standard library's, on 127.0.0.1): the
server's own naming of an input (``input[i]``: its position in one request) is translated to the call's
position for every status, and a ``Retry-After`` that is no number of seconds (nan, inf, negative) falls
back to the client's own backoff instead of failing the wait."""

from __future__ import annotations

import base64
import json
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from dice_fast.integrations._common import QueryTooLong
from dice_fast.integrations._server_client import DiceServerError, ServerEmbedder
from dice_fast.integrations._retry import RetryPolicy, retry_after_seconds

DIM = 4


class Scripted:
    """A server answering each POST with ``answer(inputs, request number) -> (status, headers, body)``."""

    def __init__(self, answer):
        self.answer, self.requests = answer, []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                script.requests.append(body)
                status, headers, reply = script.answer(body["input"], len(script.requests) - 1)
                data = json.dumps(reply).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def vectors(inputs) -> dict:
    """A 200 body: input j of the request gets the vector [len(text), j, 0, 0]."""
    rows = [np.array([len(t), j, 0, 0], "<f4") for j, t in enumerate(inputs)]
    return {"object": "list", "data": [{"object": "embedding", "index": j, "embedding": base64.b64encode(r.tobytes())
                                        .decode()} for j, r in enumerate(rows)], "usage": {}}


def refuse(status, message, param):
    return status, {}, {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "x"}}


@pytest.mark.parametrize("status", [400, 413, 422, 500])
def test_the_servers_input_positions_are_the_calls(status):
    def answer(inputs, n):
        if " " not in inputs:
            return 200, {}, vectors(inputs)
        j = inputs.index(" ")
        return refuse(status, f"input[{j}] is empty or only whitespace; every input needs text (see input[{j}])",
                      f"input[{j}]")

    with Scripted(answer) as server:
        client = ServerEmbedder(server.url, batch_size=2, max_retries=0)
        got = client.documents(["a", "bb", "ccc", "dddd"])
        assert got[:, 0].tolist() == [1, 2, 3, 4]
        with pytest.raises(DiceServerError) as e:
            client.documents(["a", "b", "c", "d", "e", " "])
    message = str(e.value)
    assert f"answered {status} for inputs 4..5 of this call: input[5] is empty" in message, message
    assert "(see input[5])" in message and "input[1]" not in message
    assert e.value.status == status and e.value.param == "input[5]"


def test_a_query_over_the_window_is_named_by_its_position_in_the_call():
    def answer(inputs, n):
        if "long" in inputs:
            j = inputs.index("long")
            return refuse(413, f"input[{j}] has 900 tokens, more than the model window holds", f"input[{j}]")
        return 200, {}, vectors(inputs)

    with Scripted(answer) as server:
        with pytest.raises(QueryTooLong) as e:
            ServerEmbedder(server.url, batch_size=2).queries(["a", "b", "c", "long"])
    assert e.value.index == 3 and e.value.param == "input[3]" and "input[3] has 900 tokens" in str(e.value)


@pytest.mark.parametrize("retry_after", ["nan", "NaN", "inf", "-inf", "-3", "1e400"])
def test_a_retry_after_that_is_no_wait_falls_back_to_the_backoff(retry_after):
    assert retry_after_seconds(retry_after) is None
    policy = RetryPolicy(max_retries=3, max_retry_seconds=10, backoff_s=0.05, rng=random.Random(0))
    wait = policy.start().wait_after(429, retry_after)
    assert math.isfinite(wait) and 0.025 <= wait <= 0.05  # the first backoff step, drawn in [w/2, w]

    def answer(inputs, n):
        return (429, {"Retry-After": retry_after}, {"error": {"message": "queue full"}}) if n == 0 else \
            (200, {}, vectors(inputs))

    with Scripted(answer) as server:
        client = ServerEmbedder(server.url, max_retries=2)
        client.retry = policy
        assert client.documents(["abc"])[:, 0].tolist() == [3]
        assert len(server.requests) == 2


def test_readable_retry_after_values_still_count():
    assert retry_after_seconds("2") == 2.0 and retry_after_seconds("0") == 0.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and retry_after_seconds("soon") is None


def test_every_client_of_the_process_shares_one_ssl_context(monkeypatch):
    """Each call built a client and with it an SSL context, loading the CA bundle (35-87 ms) on the event
    loop's thread for the async ones: 20 concurrent aembed_query calls stalled the loop for 1.5 s."""
    import asyncio

    import httpx

    from dice_fast.integrations._server_client import ssl_context

    seen = []

    class Built(Exception):
        pass

    def client(*args, **kwargs):
        seen.append(kwargs.get("verify"))
        raise Built

    monkeypatch.setattr(httpx, "Client", client)
    monkeypatch.setattr(httpx, "AsyncClient", client)
    for call in (lambda remote: remote.queries(["q"]), lambda remote: asyncio.run(remote.aqueries(["q"])),
                 lambda remote: asyncio.run(remote.adocuments(["d"]))):
        remote = ServerEmbedder("http://127.0.0.1:9", max_retries=0)
        with pytest.raises(Built):
            call(remote)
    assert len(seen) == 3 and all(v is ssl_context() for v in seen)


def test_calls_reuse_their_connection_sync_async_threads_copies(monkeypatch):
    """One connection for many calls (a client per call opened one each, and over https a TLS handshake):
    threads share the sync client; an event loop keeps its async one; another loop, a deep copy or a
    pickle gets its own."""
    import asyncio
    import copy
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    peers = []

    def answer(inputs, n):
        return 200, {}, vectors(inputs)

    with Scripted(answer) as server:
        handler = server.server.RequestHandlerClass
        setup = handler.setup

        def counted(self):
            peers.append(self.client_address)
            setup(self)

        monkeypatch.setattr(handler, "setup", counted)
        handler.protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
        remote = ServerEmbedder(server.url, batch_size=1, max_retries=0)
        for _ in range(5):
            assert remote.queries(["q", "qq"])[:, 0].tolist() == [1, 2]
        assert len(set(peers)) == 1, peers
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: remote.documents(["d"]), range(40)))
        assert len(set(peers)) <= 5  # at most one more per thread running at once

        async def several():
            return [await remote.aqueries(["abc"]) for _ in range(5)]

        before = len(set(peers))
        assert [float(v[0, 0]) for v in asyncio.run(several())] == [3.0] * 5
        assert len(set(peers)) == before + 1  # one connection for the loop's five calls
        asyncio.run(several())  # another loop: its own client (the last loop's is dropped with it)
        assert len(set(peers)) == before + 2
        assert copy.copy(remote)._connections is remote._connections  # a shallow copy shares them, as it may
        for twin in (copy.deepcopy(remote), pickle.loads(pickle.dumps(remote))):
            assert twin._connections is not remote._connections and twin.queries(["q"]).shape == (1, DIM)


def test_client_options_are_the_server_clients_arguments():
    import inspect

    from dice_fast.integrations._embedder import embedder
    from dice_fast.integrations._server_client import CLIENT_OPTIONS

    assert set(CLIENT_OPTIONS) == set(inspect.signature(ServerEmbedder).parameters) - {"base_url", "api_key", "extra"}
    with pytest.raises(TypeError, match=r"unknown client_options \['bogus'\]; allowed: batch_size"):
        embedder(None, {}, base_url="http://127.0.0.1:9", extra="langchain", bogus=1)


def test_calls_on_two_event_loops_at_once_keep_their_own_clients():
    """One async client slot for the whole embedder: a call on a second loop (another thread's
    ``asyncio.run``, as LlamaIndex's ``asyncio_run`` makes) replaced the first loop's client and had it
    closed under the call still using it ("the client has been closed")."""
    import asyncio
    import time

    def answer(inputs, n):
        time.sleep(0.02)
        return 200, {}, vectors(inputs)

    with Scripted(answer) as server:
        remote = ServerEmbedder(server.url, batch_size=1, max_retries=0)
        outcome = []

        def long_call():
            try:
                outcome.append(asyncio.run(remote.aqueries([f"q{i}" for i in range(30)])).shape)
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome.append(exc)

        first = threading.Thread(target=long_call)
        first.start()
        time.sleep(0.15)
        for _ in range(3):
            assert asyncio.run(remote.aqueries(["b"])).shape == (1, DIM)  # other loops, meanwhile
        first.join(60)
    assert outcome == [(30, DIM)], outcome
