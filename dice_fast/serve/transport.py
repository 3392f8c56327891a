"""Reading a request body and writing a response under the server's bounds (the ASGI side of the app).

* `read_body`: the body, refused as soon as its ``Content-Length`` or the bytes received so far pass
  the limit (at most the limit plus one received piece is read), or when it has not all arrived
  within ``timeout`` seconds; a body must be declared JSON (`check_content_type`).
* `LeasedResponse`: a response that holds its request's `Lease` until its last piece has been handed
  to the connection: it is written in pieces of `PIECE_BYTES`, each waiting until the client has read
  enough of the one before (the server's flow control), so a response being sent keeps counting as in
  flight, and a client that stops reading is cut off by the server's write timeout
  (`dice_fast.serve.server`) instead of pinning the whole body.
* `unless_disconnected`: await work, cancelled when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.responses import Response

from .errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType, quote

PIECE_BYTES = 1 << 18  # a response is handed to the connection 256 KiB at a time


class RequestTimeout(InvalidRequest):
    """The request body did not arrive within the read timeout (HTTP 408)."""

    code = "request_timeout"


def check_content_type(value: str | None, encoding: str | None = None) -> None:
    """Accept JSON (``application/json`` or ``*/*+json``, UTF-8), uncompressed; anything else, or none, is
    `UnsupportedMediaType` (a page in a browser can send ``text/plain`` anywhere without asking; a gzip
    body was read as JSON and refused as "not valid UTF-8", a plain one labelled gzip embedded)."""
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedMediaType(f"Content-Encoding {quote(encoding)!r} is not accepted: send the body uncompressed")
    if value is None:
        raise UnsupportedMediaType("the body must be declared JSON: send the header 'Content-Type: application/json'")
    media, *params = (part.strip().lower() for part in value.split(";"))
    charset = next((p.split("=", 1)[1].strip('"') for p in params if p.startswith("charset=")), "utf-8")
    if (media != "application/json" and not media.endswith("+json")) or charset not in ("utf-8", "utf8"):
        raise UnsupportedMediaType(f"the body must be JSON in UTF-8 (Content-Type: application/json), not "
                                   f"{quote(value)!r}")


async def read_body(request, limit: int, timeout: float | None = None) -> bytes:
    """The request body, refused with `RequestTooLarge` as soon as its Content-Length or the bytes
    received so far pass ``limit`` (the rest is never read), with `RequestTimeout` when it has not all
    arrived within ``timeout`` seconds (None: no bound)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"the request body has {int(declared)} bytes; the limit is {limit} (max_body_bytes)")
    body = bytearray()

    async def read():
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise RequestTooLarge(f"the request body has more than {limit} bytes, the limit (max_body_bytes)")

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout:g} s (read_timeout); "
                             f"{len(body)} bytes came") from None
    return bytes(body)


async def unless_disconnected(request, work):
    """Await ``work`` (a coroutine); if the client disconnects first, cancel it (the core drops its
    unstarted chunks) and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # the core drops the request's unstarted chunks
    return None


async def _disconnect(request) -> None:
    """Return when the client has gone (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class LeasedResponse(Response):
    """A response whose ``lease`` (a `Lease`, or None) is released once its last piece is handed to
    the connection, or the client has gone."""

    def __init__(self, content: bytes, lease=None, status_code: int = 200, media_type: str = "application/json",
                 headers=None):
        super().__init__(content, status_code=status_code, media_type=media_type, headers=headers)
        self.lease = lease

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            view = memoryview(self.body)
            last = max(0, len(view) - 1) // PIECE_BYTES
            for i in range(last + 1):  # each send waits while the client is behind (uvicorn's flow control)
                piece = bytes(view[i * PIECE_BYTES:(i + 1) * PIECE_BYTES])
                await send({"type": "http.response.body", "body": piece, "more_body": i < last})
        finally:
            if self.lease is not None:
                self.lease.release()
