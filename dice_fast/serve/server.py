"""The HTTP server around the app: uvicorn, with the connection bounds the app cannot set itself.

    config = server_config(app, host="127.0.0.1", port=8080, **SERVER_DEFAULTS)
    draining_server(app.state.core)(config).run()

`bounded_protocol` is uvicorn's own HTTP protocol (h11, or httptools when installed) with two timers:

* **read timeout**: the request line and headers must have arrived ``read_timeout`` seconds after
  the connection opened or its previous response ended, else the connection is closed. uvicorn's own
  keep-alive timer is cancelled by any byte, so without this a client dripping a header line a second,
  or one that connects and sends nothing, holds its connection forever. (The body has its own bound
  of the same length in the app, `dice_fast.serve.transport.read_body`: 408.)
* **write timeout**: once the connection's send buffer is full (the client has stopped reading), the
  client must read some of it within ``write_timeout`` seconds, else the connection is aborted and the
  buffered response dropped; the request's share is then released (`LeasedResponse`).

The rest is uvicorn's: ``limit_concurrency`` (connections and requests at once; more: a plain-text 503),
``timeout_keep_alive`` (an idle connection between requests), ``h11_max_incomplete_event_size`` (the
request line and headers, 16 KiB), ``backlog``.
"""

from __future__ import annotations

# name -> (default, meaning); the flag is --name-with-dashes (see dice_fast.serve.cli)
SERVER_LIMITS = {
    "max_connections": (1024, "connections and requests open at once (uvicorn's limit_concurrency); more: 503 and "
                              "the connection closed"),
    "keep_alive_timeout": (5.0, "seconds an idle keep-alive connection stays open between requests"),
    "read_timeout": (30.0, "seconds for a request's headers to arrive (from the connection's start or its last "
                           "response) and, once they have, for its body; past it the connection is closed "
                           "(a late body: 408)"),
    "write_timeout": (30.0, "seconds a client may leave a response unread once the connection's send buffer is "
                            "full; past it the connection is aborted and the response dropped"),
}
SERVER_DEFAULTS = {name: default for name, (default, _) in SERVER_LIMITS.items()}


def bounded_protocol(read_timeout: float, write_timeout: float, base=None):
    """A subclass of uvicorn's HTTP protocol (``base``, default uvicorn's "auto" choice) with the read
    and write timeouts of the module docstring. Its class attribute ``bytes_received`` counts the bytes
    read from every connection (what a test or benchmark compares with what a client sent)."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base

    class BoundedProtocol(base):
        bytes_received = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = self._write_timer = None
            self._cycle_seen = None
            self._arm_head()

        def data_received(self, data: bytes) -> None:
            type(self).bytes_received += len(data)
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._cycle_seen:  # a request's headers are in
                self._cycle_seen = self.cycle
                self._disarm("_head_timer")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head()

        def pause_writing(self) -> None:
            super().pause_writing()
            self._disarm("_write_timer")
            self._write_timer = self.loop.call_later(write_timeout, self._abort)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._disarm("_write_timer")

        def connection_lost(self, exc) -> None:
            self._disarm("_head_timer")
            self._disarm("_write_timer")
            super().connection_lost(exc)

        def _arm_head(self) -> None:
            self._disarm("_head_timer")
            self._head_timer = self.loop.call_later(read_timeout, self._close_idle)

        def _disarm(self, name: str) -> None:
            timer = getattr(self, name, None)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _close_idle(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def _abort(self) -> None:
            self._write_timer = None
            self.transport.abort()  # drops what is buffered: the client never read it

    return BoundedProtocol


def server_config(app, *, host: str, port: int, max_connections: int, keep_alive_timeout: float,
                  read_timeout: float, write_timeout: float, protocol=None, **uvicorn_options):
    """A ``uvicorn.Config`` serving ``app`` on ``host``:``port`` under the bounds of `SERVER_LIMITS`
    (``protocol``: a `bounded_protocol` class to use, e.g. to read its ``bytes_received``)."""
    import uvicorn

    for name, value in (("max_connections", max_connections), ("keep_alive_timeout", keep_alive_timeout),
                        ("read_timeout", read_timeout), ("write_timeout", write_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    protocol = protocol or bounded_protocol(read_timeout, write_timeout)
    return uvicorn.Config(app, host=host, port=port, http=protocol, limit_concurrency=int(max_connections),
                          timeout_keep_alive=keep_alive_timeout, **uvicorn_options)


def draining_server(core):
    """A ``uvicorn.Server`` class whose SIGTERM / Ctrl-C first marks ``core`` draining (``/health`` 503
    "draining") while uvicorn finishes the requests in flight."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            core.drain()
            super().handle_exit(sig, frame)

    return DrainingServer
