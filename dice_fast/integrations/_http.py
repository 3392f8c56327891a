"""The HTTP clients of the adapters' server client (`ServerEmbedder`), kept between calls.

A client per call opened a connection, and over https a TLS handshake, for every call: one
``embed_query`` per question paid it each time. `Connections` keeps one ``httpx.Client`` for the
process's threads (httpx's sync client "can be shared between threads"; a forked child makes its own:
the parent's sockets are not its to use) and one ``httpx.AsyncClient`` for the event loop that called
last (an async client's connections belong to one loop: a call on another loop makes a new one). An
async client is closed on its own loop when that loop shuts down (``asyncio.run`` closes the loop's
async generators, and one holds the client) or when a call on another loop replaces it. Every client of the process shares one SSL context
(`ssl_context`). httpx is imported on first use (a dependency of langchain-core and llama-index-core).
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref

_SSL_LOCK, _SSL = threading.Lock(), []


def ssl_context():
    """One SSL context for every HTTP client of the process: httpx builds one per client, loading the CA
    bundle (35-87 ms), on the event loop thread for an async client, for every call."""
    with _SSL_LOCK:
        if not _SSL:
            import httpx

            _SSL.append(httpx.create_ssl_context())
        return _SSL[0]


class Connections:
    """The HTTP clients of one server client (see the module docstring); ``timeout``: seconds per
    request. A copy or an unpickled one has the same timeout and clients of its own."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sync = None  # (pid, httpx.Client)
        self._async = None  # (weakref to its loop, httpx.AsyncClient, the generator closing it, pid)

    def __reduce__(self):  # pickle, copy and deepcopy: the timeout, never the clients or the lock
        return Connections, (self.timeout,)

    def sync(self, httpx):
        """The process's ``httpx.Client`` (made on first use, and again in a forked child)."""
        with self._lock:
            if self._sync is None or self._sync[0] != os.getpid():
                client = httpx.Client(timeout=self.timeout, verify=ssl_context())
                self._sync = (os.getpid(), client)
                weakref.finalize(self, client.close)  # its sockets close with the last server client using them
            return self._sync[1]

    async def for_loop(self, httpx):
        """The ``httpx.AsyncClient`` of the running event loop (made when the loop is not the last one's)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._async is not None and self._async[0]() is loop and self._async[3] == os.getpid():
                return self._async[1]
            client = httpx.AsyncClient(timeout=self.timeout, verify=ssl_context())
            holder = _closed_with_its_loop(client)
            self._async = (weakref.ref(loop), client, holder, os.getpid())  # the last loop's: dropped, closed
        await holder.__anext__()  # runs to its yield at once: now the loop closes it when it shuts down
        return client


async def _closed_with_its_loop(client):
    """Yields ``client`` once and closes it when closed: the loop that first iterated it does so when it
    shuts down (its async generators), or when it is dropped (the loop's finalizer hook)."""
    try:
        yield client
    finally:
        await client.aclose()
