"""The adapters' client of a running ``dice-fast serve``: `ServerEmbedder`, its errors, and the HTTP
clients it keeps between calls.

A client per call opened a connection, and over https a TLS handshake, for every call: one
``embed_query`` per question paid it each time. `Connections` keeps one ``httpx.Client`` for the
process's threads (httpx's sync client "can be shared between threads"; a forked child makes its own:
the parent's sockets are not its to use) and one ``httpx.AsyncClient`` per running asyncio event loop
(an async client's connections belong to one loop), closed on its own loop when that loop shuts down
(``asyncio.run`` closes the loop's async generators, and one holds the client; a loop closed without
that leaves it to the garbage collector); under trio, a client per call. Every client of the process
shares one SSL context (`ssl_context`). httpx is imported on first use (a dependency of langchain-core
and llama-index-core).

The client retries what waiting can fix (429 queue full, 503, connection failures; `RetryPolicy`:
bounded tries and time, ``Retry-After`` honoured, jitter) and raises `DiceServerError` for everything
else, transport errors included (``status`` None: no response).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import threading
import time
import warnings
import weakref

import numpy as np

from ..config import checked_integer
from ..errors import DiceError, require
from ._common import QueryTooLong, jsonable
from ._retry import RetryPolicy

CLIENT_OPTIONS = ("batch_size", "timeout", "max_retries", "max_retry_seconds", "strategy")  # ServerEmbedder's
_KINDS = {"documents": "document", "queries": "query"}


_SSL_LOCK, _SSL = threading.Lock(), []


def ssl_context():
    """One SSL context for every HTTP client of the process: httpx builds one per client, loading the CA
    bundle (35-87 ms), on the event loop thread for an async client, for every call. Built outside the
    lock (a fork meanwhile must not leave the child a lock held for good)."""
    with _SSL_LOCK:
        if _SSL:
            return _SSL[0]
    import httpx

    context = httpx.create_ssl_context()
    with _SSL_LOCK:
        if not _SSL:
            _SSL.append(context)
        return _SSL[0]


class Connections:
    """The HTTP clients of one server client (see the module docstring); ``timeout``: seconds per
    request. A copy or an unpickled one has the same timeout and clients of its own. Clients are built
    outside the lock (a fork meanwhile must not leave the child a lock held for good)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._sync = None  # httpx.Client
        self._loops: dict = {}  # id(loop) -> (weakref to the loop, its httpx.AsyncClient, the generator closing it)

    def __reduce__(self):  # pickle, copy and deepcopy: the timeout, never the clients or the lock
        return Connections, (self.timeout,)

    def _forget_the_parents(self) -> None:  # under the lock: a forked child makes its own clients
        if self._pid != os.getpid():
            self._pid, self._sync, self._loops = os.getpid(), None, {}

    def sync(self, httpx):
        """The process's ``httpx.Client`` (made on first use, and again in a forked child)."""
        with self._lock:
            self._forget_the_parents()
            if self._sync is not None:
                return self._sync
        client = httpx.Client(timeout=self.timeout, verify=ssl_context())
        with self._lock:
            if self._sync is None:
                self._sync = client
                weakref.finalize(self, client.close)  # its sockets close with the last server client using them
                return client
            kept = self._sync
        client.close()  # another thread's came first
        return kept

    @contextlib.asynccontextmanager
    async def async_client(self, httpx):
        """The running asyncio loop's ``httpx.AsyncClient``, kept while the loop runs; under another
        async library (trio) a client for this call only."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no asyncio loop (trio, anyio on trio): nothing to keep a client for
            async with httpx.AsyncClient(timeout=self.timeout, verify=ssl_context()) as client:
                yield client
            return
        yield await self._of_loop(httpx, loop)

    async def _of_loop(self, httpx, loop):
        with self._lock:
            self._forget_the_parents()
            for key, (ref, *_) in list(self._loops.items()):  # loops gone or closed: theirs closed at shutdown
                if ref() is None or ref().is_closed():
                    del self._loops[key]
            kept = self._loops.get(id(loop))
            if kept is not None and kept[0]() is loop:
                return kept[1]
        client = httpx.AsyncClient(timeout=self.timeout, verify=ssl_context())
        holder = _closed_with_its_loop(client)  # kept here: the loop holds its async generators weakly
        with self._lock:  # no await since the look-up: no other call of this loop came between
            self._loops[id(loop)] = (weakref.ref(loop), client, holder)
        await holder.__anext__()  # runs to its yield at once: now the loop closes it when it shuts down
        return client


async def _closed_with_its_loop(client):
    """Yields ``client`` once and closes it when closed: the loop that first iterated it does so when it
    shuts down (``asyncio.run`` closes the loop's async generators)."""
    try:
        yield client
    finally:
        await client.aclose()


class DiceServerError(DiceError, RuntimeError):
    """A running ``dice-fast serve`` refused or failed a request, or could not be reached (a `DiceError`,
    so one ``except DiceError`` covers an adapter in-process and through a server); ``status`` is
    its HTTP status (None: no response came, e.g. a refused connection or a timeout); ``param``: the
    field the server blamed (``"input[7]"``, ``"dimensions"`` ...; None when it named none). An input is
    named by its position in the whole call, in ``param`` and in the message alike."""

    def __init__(self, message: str, status: int | None, param: str | None = None):
        Exception.__init__(self, message)  # not super(): in ServerQueryTooLong that is QueryTooLong's
        self.status = status
        self.param = param


class ServerQueryTooLong(DiceServerError, QueryTooLong):
    """The server refused a query longer than its model window (413): both a `DiceServerError` and a
    `QueryTooLong`, as the same query is in-process."""

    def __init__(self, message: str, status: int, index: int, param: str | None = None):
        DiceServerError.__init__(self, message, status, param)
        self.index = index


class ServerEmbedder:
    """A running ``dice-fast serve`` (or any server of its OpenAI-shaped API with ``input_type``).

    base_url: ``http://host:port`` (a trailing ``/v1`` is accepted); api_key: sent as
    ``Authorization: Bearer <key>`` when given; batch_size: inputs per request (the server packs
    requests together, so this bounds request size, not speed); timeout: seconds per request;
    max_retries / max_retry_seconds: a request answered 429 or 503, or that met a connection error, is
    tried again up to ``max_retries`` times, none starting after ``max_retry_seconds`` from its first
    try, waiting the server's ``Retry-After`` (else 0.5 s doubling), with jitter (`RetryPolicy`).
    strategy: sent with documents as the request's ``strategy`` (None: the server's; "late": late chunking).
    Responses are requested in base64 (exact float32). Errors raise `DiceServerError` with the server's
    message (or the transport error) and the call's positions of the inputs of the failed request.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, batch_size: int = 64, timeout: float = 300.0,
                 max_retries: int = 3, max_retry_seconds: float = 60.0, extra: str = "serve",
                 strategy: str | None = None):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        batch_size = checked_integer("batch_size", batch_size)
        root = base_url.rstrip("/")
        self.url = (root[:-3] if root.endswith("/v1") else root) + "/v1/embeddings"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        from ..settings import check_strategy

        self.strategy = None if strategy is None else check_strategy(strategy)
        self.batch_size, self.timeout, self._extra = batch_size, timeout, extra
        self.retry = RetryPolicy(max_retries, max_retry_seconds)
        self._connections = Connections(timeout)  # kept between calls: one connection, not one per call
        self.base_url = base_url
        self.client_options = {"batch_size": batch_size, "timeout": timeout, "max_retries": max_retries,
                               "max_retry_seconds": max_retry_seconds, "strategy": self.strategy}

    def __setstate__(self, state: dict) -> None:  # one pickled by an earlier version has no _connections
        self.__dict__.update(state)
        if "_connections" not in state:
            self._connections = Connections(self.timeout)

    def describe(self) -> dict:
        """JSON-able ``{"source": "server", "base_url": ..., "client_options": {...}}`` (no api_key: a
        description may be logged or saved); ``rebuild_arguments`` builds it again from this."""
        return {"source": "server", "base_url": self.base_url, "client_options": jsonable(dict(self.client_options))}

    @property
    def name(self) -> str:
        return self.url

    def documents(self, texts: list[str]) -> np.ndarray:
        return self._run(texts, "documents")

    def queries(self, texts: list[str]) -> np.ndarray:
        return self._run(texts, "queries")

    async def adocuments(self, texts: list[str]) -> np.ndarray:
        return await self._arun(texts, "documents")

    async def aqueries(self, texts: list[str]) -> np.ndarray:
        return await self._arun(texts, "queries")

    # ----------------------------------------------------------------------------------------------
    def _batches(self, texts, kind: str):
        texts = list(texts)
        for lo in range(0, len(texts), self.batch_size):
            batch = texts[lo:lo + self.batch_size]
            fields = {"input": batch, "input_type": _KINDS[kind], "encoding_format": "base64"}
            if self.strategy is not None and kind == "documents":
                fields["strategy"] = self.strategy
            body = json.dumps(fields)
            yield lo, len(batch), body.encode("utf-8")

    def _run(self, texts, kind: str) -> np.ndarray:
        httpx = require("httpx", extra=self._extra, needed_by="a remote dice_fast server")
        rows = []
        client = self._connections.sync(httpx)
        for lo, n, body in self._batches(texts, kind):
            attempts = self.retry.start()
            while True:
                response, error = None, None
                try:
                    response = client.post(self.url, content=body, headers=self.headers)
                except httpx.TransportError as exc:
                    error = exc
                wait = self._wait(httpx, attempts, response, error)
                if wait is None:
                    break
                time.sleep(wait)
            rows.append(self._vectors(response, lo, n, error, attempts, kind))
        return _stack(rows)

    async def _arun(self, texts, kind: str) -> np.ndarray:
        httpx = require("httpx", extra=self._extra, needed_by="a remote dice_fast server")
        rows = []
        import anyio  # httpx's own dependency: sleeps under asyncio and trio alike

        async with self._connections.async_client(httpx) as client:
            for lo, n, body in self._batches(texts, kind):
                attempts = self.retry.start()
                while True:
                    response, error = None, None
                    try:
                        response = await client.post(self.url, content=body, headers=self.headers)
                    except httpx.TransportError as exc:
                        error = exc
                    wait = self._wait(httpx, attempts, response, error)
                    if wait is None:
                        break
                    await anyio.sleep(wait)
                rows.append(self._vectors(response, lo, n, error, attempts, kind))
        return _stack(rows)

    @staticmethod
    def _wait(httpx, attempts, response, error) -> float | None:
        """Seconds before the next try, or None: this response (or error) is the answer."""
        if error is not None:  # a timeout while reading the answer is not retried: the work may still be running
            retryable = isinstance(error, (httpx.NetworkError, httpx.ConnectTimeout, httpx.PoolTimeout,
                                           httpx.RemoteProtocolError))
            return attempts.wait_after(None) if retryable else None
        return attempts.wait_after(response.status_code, response.headers.get("Retry-After"))

    def _vectors(self, response, lo: int, n: int, failure=None, attempts=None, kind: str = "documents") -> np.ndarray:
        """(n, dim) float32 from a response to the inputs ``lo .. lo + n - 1`` of the call (``failure``:
        the transport error instead, after ``attempts``)."""
        where = f"inputs {lo}..{lo + n - 1} of this call" if n > 1 else f"input {lo} of this call"
        tries = "" if attempts is None else f" (after {attempts.made} tries in {attempts.elapsed:.1f} s)"
        if failure is not None:
            raise DiceServerError(f"no response from {self.url} for {where}{tries}: "
                                  f"{type(failure).__name__}: {str(failure)[:200]}", None) from failure
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code != 200:
            error = body.get("error") if isinstance(body, dict) else None
            message = error.get("message") if isinstance(error, dict) else response.text[:300]
            message = _in_call(str(message), lo)  # the server names inputs of its request: name them in the call
            retried = tries if response.status_code in (429, 503) else ""
            text = f"{self.url} answered {response.status_code} for {where}{retried}: {message}"
            param = error.get("param") if isinstance(error, dict) else None
            param = _in_call(param, lo) if isinstance(param, str) else None
            at = re.fullmatch(r"input\[(\d+)\]", param) if param is not None else None
            if response.status_code == 413 and kind == "queries" and at and "model window" in message:
                raise ServerQueryTooLong(text, 413, int(at.group(1)), param)
            raise DiceServerError(text, response.status_code, param)
        cut = body.get("usage", {}).get("truncated_inputs") if isinstance(body, dict) else None
        if cut:
            warnings.warn(f"{len(cut)} queries longer than the model window were cut to it by the server "
                          f"(--auto-truncate): {', '.join(f'query {lo + int(i)}' for i in cut[:3])} of this call",
                          UserWarning, stacklevel=4)
        try:
            data = sorted(body["data"], key=lambda d: d["index"])
            rows = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
        except (TypeError, KeyError, ValueError) as exc:
            raise DiceServerError(f"{self.url} sent a malformed response for {where}: {exc!r}", 200) from None
        if len(rows) != n:
            raise DiceServerError(f"{self.url} returned {len(rows)} vectors for {n} inputs ({where})", 200)
        return rows.astype(np.float32)


def _in_call(text: str, lo: int) -> str:
    """``text`` with every ``input[i]`` (a position in one request, whose first input is the call's
    ``lo``) renamed ``input[lo + i]``, the position in the whole call."""
    return re.sub(r"\binput\[(\d+)\]", lambda m: f"input[{lo + int(m.group(1))}]", text)


def _stack(rows: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)
