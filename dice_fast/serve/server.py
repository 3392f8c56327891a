"""The HTTP server around the app: uvicorn, with the connection bounds the app cannot set itself.

    config = server_config(app, host="127.0.0.1", port=8080, **SERVER_DEFAULTS)
    draining_server(app.state.core)(config).run()

`bounded_protocol` is uvicorn's h11 protocol (always: with httptools installed uvicorn's "auto" would pick
httptools, whose parser none of the bounds below reach) with two timers:

* **read timeout**: the request line and headers must have arrived ``read_timeout`` seconds after
  the connection opened or its previous response ended, else the connection is closed. uvicorn's own
  keep-alive timer is cancelled by any byte, so without this a client dripping a header line a second,
  or one that connects and sends nothing, holds its connection forever. (The body has its own bound
  of the same length in the app, `dice_fast.serve.transport.read_body`: 408.)
* **write timeout**: once the connection's send buffer is full (the client has stopped reading), the
  client must read some of it within ``write_timeout`` seconds, else the connection is aborted and the
  buffered response dropped; the request's share is then released (`LeasedResponse`).
* **pieces of a body**: a body that comes in more than `MANY_PIECES` pieces (chunks of a chunked
  body, or reads) averaging under `MIN_PIECE_BYTES` is refused with 400 and the connection closed.
  h11 parses each piece in Python on the event loop (~10 us): 2 MiB in 1-byte chunks held the loop
  ~21 s, stalling every other client, where the same bytes in any usual framing take milliseconds.
* **lingering close**: a response that closes the connection (an early 413 before the body is read,
  a 401, a 400) is followed by a half-close: the server stops writing (FIN after the response), then
  reads and drops what the client still sends, for at most `LINGER_SECONDS` and `LINGER_BYTES`, and
  closes when the client has finished. Closing at once, with the client's body still arriving, resets
  the connection, and the client's kernel drops the response it was about to read (seen as transport
  errors on half the early 413s of a soak). Dropped bytes are counted in ``bytes_discarded``, apart
  from ``bytes_received``.
* **a client's EOF** before its response is the client going away, as nginx takes it (499): the
  connection closes and the request's work not yet started is dropped. TCP cannot tell a client that
  closed from one that only half-closed after sending (``shutdown(SHUT_WR)``, as ``nc -N`` does), and
  answering the second would leave every abandoned request running to its end.

The rest is uvicorn's: ``limit_concurrency`` (connections and requests at once; more: a plain-text 503),
``timeout_keep_alive`` (an idle connection between requests), ``h11_max_incomplete_event_size`` (the
request line and headers, 16 KiB), ``backlog``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

from ..errors import OptionError

log = logging.getLogger("dice_fast.serve")

# name -> (default, meaning); the flag is --name-with-dashes (see dice_fast.serve.cli)
SERVER_LIMITS = {
    "max_connections": (1024, "connections and requests open at once (uvicorn's limit_concurrency); more: 503 and "
                              "the connection closed"),
    "keep_alive_timeout": (5.0, "seconds an idle keep-alive connection stays open between requests (at most "
                                "read_timeout, which closes an idle connection too)"),
    "read_timeout": (30.0, "seconds for a request's headers to arrive (from the connection's start or its last "
                           "response) and, once they have, for its body; past it the connection is closed "
                           "(a late body: 408)"),
    "write_timeout": (30.0, "seconds a client may leave a response unread once the connection's send buffer is "
                            "full; past it the connection is aborted and the response dropped"),
}
SERVER_DEFAULTS = {name: default for name, (default, _) in SERVER_LIMITS.items()}
LINGER_SECONDS = 2.0  # after a closing response: how long what a client still sends is read and dropped
LINGER_BYTES = 16 << 20  # ... and how much of it, at most, before the connection is closed regardless
MANY_PIECES = 4096  # a body in more pieces than this (h11 Data events) ...
MIN_PIECE_BYTES = 32  # ... must average at least this many bytes a piece, else 400 (see the docstring)


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: ``close()`` starts the protocol's lingering close;
    everything else is the transport's own."""

    def __init__(self, transport, protocol):
        self._transport, self._protocol = transport, protocol

    def close(self) -> None:
        self._protocol.start_linger()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def __getattr__(self, name):
        return getattr(self._transport, name)


def bounded_protocol(read_timeout: float, write_timeout: float):
    """A subclass of uvicorn's h11 protocol with the bounds of the module docstring. Its class attribute
    ``bytes_received`` counts the bytes read from every connection (what a test or benchmark compares
    with what a client sent)."""
    import h11  # uvicorn's own dependency (its h11 protocol, with a few methods below)
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedProtocol(H11Protocol):
        bytes_received = 0
        bytes_discarded = 0

        def connection_made(self, transport) -> None:
            self._real = transport
            self.lingering, self._linger_timer, self._linger_left = False, None, LINGER_BYTES
            super().connection_made(_LingeringTransport(transport, self))
            self._head_timer = self._write_timer = None
            self._cycle_seen = self._refusal = None
            self._next_event, self.conn.next_event = self.conn.next_event, self._counted_event  # count the pieces
            self._pieces = self._piece_bytes = 0
            self._arm_head()

        def data_received(self, data: bytes) -> None:
            if self.lingering:  # the response is sent and the write side shut: drop what still comes
                type(self).bytes_discarded += len(data)
                self._linger_left -= len(data)
                if self._linger_left < 0:
                    self._real.close()
                return
            type(self).bytes_received += len(data)
            super().data_received(data)
            self._new_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request already read
            if not self._new_request() and not self.transport.is_closing():
                self._arm_head()

        def _new_request(self) -> bool:
            """Whether a request's head has come in since the last call: then its read timer stops (a
            pipelined request waiting in the queue was cut off by it), and a head framed by both
            Content-Length and Transfer-Encoding gets its connection closed after the response (RFC
            9112 6.1: a proxy framing by the length would read a second, smuggled request)."""
            if self.cycle is None or self.cycle is self._cycle_seen:
                return False
            self._cycle_seen = self.cycle
            self._disarm("_head_timer")
            names = {name for name, _ in self.cycle.scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                self.cycle.scope["headers"].append((b"connection", b"close"))  # uvicorn: close after answering
            return True

        def _counted_event(self):
            """h11's next event, counting the pieces of the current request's body (`MANY_PIECES`)."""
            event = self._next_event()
            if isinstance(event, h11.Request):
                self._pieces = self._piece_bytes = 0
            elif isinstance(event, h11.Data):
                self._pieces += 1
                self._piece_bytes += len(event.data)
                if self._pieces > MANY_PIECES and self._piece_bytes < MIN_PIECE_BYTES * self._pieces:
                    self._refusal = (f"the body came in more than {MANY_PIECES} pieces of {self._piece_bytes / self._pieces:.1f} "
                                     f"bytes on average; send it in pieces of at least {MIN_PIECE_BYTES} bytes")
                    raise h11.RemoteProtocolError(self._refusal)  # uvicorn answers it with send_400_response
            return event

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse: 400 in OpenAI's error shape with its length and date, then
            close (uvicorn's was plain text, delimited by the close, without a Date)."""
            msg = self._refusal or msg  # uvicorn passes one message for every parse error
            body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}", "type": "invalid_request_error",
                                         "param": None, "code": "bad_http_request"}}).encode()
            headers = [*self.server_state.default_headers, (b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

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
            self._disarm("_linger_timer")
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
            self._real.close()  # nothing of a request is in flight: no linger

        def start_linger(self) -> None:
            """Instead of closing: FIN once the response is flushed, keep reading (and dropping) until
            the client closes too, or `LINGER_SECONDS` / `LINGER_BYTES` have passed."""
            real = self._real
            if self.lingering or real.is_closing() or not real.can_write_eof():
                real.close()
                return
            self.lingering = True
            self._disarm("_head_timer")
            try:
                real.write_eof()
            except OSError:  # the client has gone already (ENOTCONN): nothing to linger for
                real.close()
                return
            real.resume_reading()  # uvicorn may have paused it while the app did not read the body
            self._linger_timer = self.loop.call_later(LINGER_SECONDS, real.close)

        def eof_received(self):
            if self.lingering:
                self._real.close()
                return None
            return super().eof_received()  # None: asyncio closes the connection (the module docstring)

        def _abort(self) -> None:
            self._write_timer = None
            self._real.abort()  # drops what is buffered: the client never read it

    return BoundedProtocol


def check_server_limits(**values) -> None:
    """`ValueError` naming the first of the `SERVER_LIMITS` given that is not a number > 0."""
    for name, value in values.items():
        if name not in SERVER_LIMITS:
            raise TypeError(f"unknown server limit {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")


FILES_BESIDE_CONNECTIONS = 128  # open files the process needs beside its connections, over those open now


def ensure_open_files(max_connections: int) -> None:
    """Raise this process's soft limit on open files (``ulimit -n``) to what ``max_connections`` needs,
    up to its hard limit; `OptionError` naming ``--max-connections`` when the hard limit is lower. (With
    the usual soft limit of 1,024 and the default 1,024 connections the server ran out of descriptors
    first: it never sent its 503, and asyncio's accept loop spun at full CPU, logging each failure.)"""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 64
    need = int(max_connections) + open_now + FILES_BESIDE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise OptionError(f"--max-connections {max_connections} needs {need} open files, more than this process "
                          f"may open ({hard}: ulimit -Hn); lower it to at most {max(hard - need + int(max_connections), 1)}, "
                          "or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def server_config(app, *, host: str, port: int, max_connections: int, keep_alive_timeout: float,
                  read_timeout: float, write_timeout: float, protocol=None, **uvicorn_options):
    """A ``uvicorn.Config`` serving ``app`` on ``host``:``port`` under the bounds of `SERVER_LIMITS`
    (``protocol``: a `bounded_protocol` class to use, e.g. to read its ``bytes_received``)."""
    import uvicorn

    check_server_limits(max_connections=max_connections, keep_alive_timeout=keep_alive_timeout,
                        read_timeout=read_timeout, write_timeout=write_timeout)
    ensure_open_files(max_connections)
    protocol = protocol or bounded_protocol(read_timeout, write_timeout)
    return uvicorn.Config(app, host=host, port=port, http=protocol, limit_concurrency=int(max_connections),
                          timeout_keep_alive=keep_alive_timeout, **uvicorn_options)


def log_config(level: str) -> dict:
    """uvicorn's logging configuration with dice_fast's loggers on its handler, at ``level`` (dice_fast's
    own lines were left to Python's last-resort handler: bare, and printed whatever --log-level said)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["dice_fast"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def draining_server(core):
    """A ``uvicorn.Server`` class whose SIGTERM / Ctrl-C first marks ``core`` draining (``/health`` 503
    "draining") while uvicorn finishes the requests in flight, then returns (uvicorn raised the signal
    again: Ctrl-C read as an error, SIGTERM as a kill); and that shuts down by itself once ``core`` is
    unhealthy (a failed warm-up, a worker that stopped), so that a supervisor can restart the process."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            core.drain()
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if counter % 10 == 0 and not self.should_exit:
                state, why = core.health
                if state == "unhealthy":
                    log.error("dice_fast.serve: the encoder is unhealthy (%s); shutting down", why)
                    self.should_exit = True
            return await super().on_tick(counter)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()  # handled: the drain is done (uvicorn 0.30-0.55 re-raises these)

    return DrainingServer
