"""The HTTP layer: an ASGI app (FastAPI) over an `AsyncDiceEncoder`, built by `create_app`.

    app = create_app(DiceEncoder.from_pretrained(), max_queue_tokens=200_000)
    uvicorn.run(app, host="127.0.0.1", port=8080)         # or mount it: parent.mount("/dice", app)

Routes: ``POST /v1/embeddings`` (OpenAI-shaped, see `dice_fast.serve.schemas`), ``GET /health``,
``GET /v1/models``, ``GET /metrics`` (Prometheus text), and FastAPI's ``/openapi.json``, ``/docs`` and
``/redoc``. The app checks the API key, counts the body in as it streams, parses, maps the core's errors
to status codes and serialises; batching, the token limits and encoding live in the core.

With an API key every route but ``/health`` needs ``Authorization: Bearer <key>`` (compared in constant
time), ``/metrics`` and ``/openapi.json`` included; ``/docs`` and ``/redoc`` are off (a browser page
cannot send the key).

Status codes: 200; 401 (with ``WWW-Authenticate: Bearer``) no key or the wrong one; 413 a request over
a size limit (body bytes, inputs, characters, tokens); 415 a body declared as other than JSON; 422 a
malformed body; 429 (with ``Retry-After``) the queue or the concurrency limit is full; 503 shutting
down; 499 is logged (never sent) when the client went away and its unstarted chunks were dropped; 503
``out_of_memory`` (naming the input) when one of its chunks ran out of memory alone, 503 ``unhealthy``
when the worker has stopped; 504 past ``request_timeout``; 500 only for another failure of the model
itself. Error bodies are OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

This module imports fastapi; ``dice_fast.serve`` imports it only when `create_app` is first used.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..matryoshka import truncate
from ..runinfo import model_label
from .batcher import AsyncDiceEncoder
from .errors import (DeadlineExceeded, InvalidRequest, OutOfMemory, Overloaded, RequestTooLarge, ServeError,
                     ShuttingDown, Unauthorized, Unhealthy, UnsupportedMediaType, internal_error_body)
from .limits import default_max_body_bytes
from .metrics import CONTENT_TYPE, ServerMetrics
from .schemas import REQUEST_SCHEMA, embedding_response, parse_embedding_request
from .evidence import add_evidence_route

log = logging.getLogger("dice_fast.serve")

STATUS = {InvalidRequest: 422, UnsupportedMediaType: 415, RequestTooLarge: 413, Overloaded: 429, ShuttingDown: 503,
          Unauthorized: 401, OutOfMemory: 503, Unhealthy: 503, DeadlineExceeded: 504}
CLIENT_GONE = 499  # nginx's "client closed request": counted in metrics, never sent
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (probes)
_OFF_LOOP_FLOATS = 1 << 16  # responses with more floats than this are serialised in a worker thread
_OFF_LOOP_BYTES = 1 << 16  # request bodies longer than this are parsed in a worker thread


def create_app(encoder, *, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int | None = None, **limits):
    """A FastAPI app serving ``encoder``.

    encoder: a `DiceEncoder` (the app builds an `AsyncDiceEncoder` over it with ``limits``, the keyword
    arguments of `AsyncDiceEncoder`, and closes it at shutdown) or an `AsyncDiceEncoder` you own (then
    pass no limits; several apps may share it). model_name: the name reported in responses and
    ``/v1/models`` (default: the model folder's name). api_key: when given, every route but ``/health``
    needs ``Authorization: Bearer <api_key>`` (401 otherwise) and the /docs and /redoc pages are off.
    max_body_bytes: a longer request body gets 413 as soon as its Content-Length or its bytes so far
    show it (default: 8 per token of the core's ``max_queue_tokens``; see `dice_fast.serve.limits`).
    """
    if isinstance(encoder, AsyncDiceEncoder):
        if limits:
            raise TypeError(f"limits ({', '.join(limits)}) belong to the AsyncDiceEncoder passed in; set them there")
        core, owned = encoder, False
    else:
        core, owned = AsyncDiceEncoder(encoder, **limits), True
    if max_body_bytes is not None and (not isinstance(max_body_bytes, int) or max_body_bytes < 1):
        raise ValueError(f"max_body_bytes must be an integer >= 1, got {max_body_bytes!r}")
    body_limit = max_body_bytes or default_max_body_bytes(core.max_queue_tokens)
    name = model_name or model_label(core.encoder.spec.name)
    metrics = ServerMetrics(core)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        core.start()  # the worker runs a warm-up forward; /health is 503 "starting" until it has
        yield
        if owned:  # uvicorn has finished the requests in flight by now; drain and stop the worker
            await core.aclose()

    pages = {"docs_url": None, "redoc_url": None} if api_key is not None else {}
    app = FastAPI(title="dice-fast embeddings", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible DICE long-document embeddings.", **pages)
    app.state.core, app.state.metrics, app.state.model_name = core, metrics, name
    app.state.max_body_bytes = body_limit
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=check_api_key(api_key), on_refused=metrics.observe_unauthorized)

    def error(exc: ServeError) -> JSONResponse:
        status = STATUS.get(type(exc), 422)
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else None
        return JSONResponse(exc.body(), status_code=status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # 404, 405 in OpenAI's shape
        body = {"error": {"message": f"{exc.detail}: {request.method} {request.url.path}",
                          "type": "invalid_request_error", "param": None, "code": str(exc.status_code)}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def read_request(request: Request, parse, *args):
        """``parse(body, *args)`` of the request's body, once its content type is checked and its bytes,
        counted as they stream in, are within the body limit (parsed off the event loop when large)."""
        _check_content_type(request.headers.get("content-type"))
        body = await _read_body(request, body_limit)
        if len(body) > _OFF_LOOP_BYTES:
            return await asyncio.get_running_loop().run_in_executor(None, parse, body, *args)
        return parse(body, *args)

    async def answer(label: str, handle) -> Response:
        """The routes' shared frame. ``handle(labels)`` returns (JSON bytes, inputs, tokens), or None when
        the client has gone, and may set ``labels[0]`` (the metrics' input type) once it knows it. A
        `ServeError` is answered in OpenAI's shape, a client gone gets 499 (counted, never sent), any
        other error 500 (logged: the model failed, never the client's fault); each is counted in /metrics."""
        start, labels = time.perf_counter(), [label]
        try:
            result = await handle(labels)
        except ServeError as exc:
            metrics.observe_request(labels[0], STATUS.get(type(exc), 422))
            return error(exc)
        except ClientDisconnect:  # gone while sending the body
            result = None
        except Exception:
            log.exception("dice_fast.serve: %s request failed", labels[0])
            metrics.observe_request(labels[0], 500)
            return JSONResponse(internal_error_body(), status_code=500)
        if result is None:
            metrics.observe_request(labels[0], CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        content, inputs, tokens = result
        metrics.observe_request(labels[0], 200, time.perf_counter() - start, inputs, tokens)
        return Response(content, media_type="application/json")

    @app.post("/v1/embeddings", summary="Embed documents or queries",
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"application/json": {"schema": REQUEST_SCHEMA}}}})
    async def embeddings(request: Request):
        async def handle(labels):
            req = await read_request(request, parse_embedding_request, core.dim)
            labels[0] = req.input_type
            if req.input_type == "query":
                work = core.embed_queries(req.input)
            else:
                work = core.embed_documents(req.input, return_chunks=req.return_chunks)
            out = await _unless_disconnected(request, work)
            if out is None:
                return None
            vectors = truncate(out.vectors, req.dimensions, core.encoder.config.normalize)
            chunks = out.chunks
            if chunks is not None and req.dimensions is not None:
                chunks = replace(chunks, chunks=truncate(chunks.chunks, req.dimensions, core.encoder.normalize_chunks))
            args = (vectors, out.tokens, name, req.encoding_format, out.truncated, chunks)
            floats = vectors.size + (chunks.chunks.size if chunks is not None else 0)
            if floats > _OFF_LOOP_FLOATS:
                content = await asyncio.get_running_loop().run_in_executor(None, embedding_response, *args)
            else:
                content = embedding_response(*args)
            return content, len(req.input), int(out.tokens.sum())

        return await answer("unknown", handle)

    add_evidence_route(app, core, name, read_request, answer, _unless_disconnected)

    @app.get("/health", summary="Readiness and queue state")
    async def health():  # 200 "ok"; 503 "starting" (no warm-up yet), "draining" (SIGTERM), "unhealthy"
        if not core.closed:
            core.start()  # a mounted app gets no lifespan: its first probe starts the worker and warm-up
        status, detail = core.health
        body = {"status": status, "model": name, "queue_tokens": core.tokens_waiting,
                "requests_in_flight": core.requests_in_flight}
        if detail:
            body["detail"] = detail
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models", summary="The served model")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "dice-fast", "dimensions": core.dim}]}

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


class BearerAuth:
    """ASGI middleware: every HTTP request to a path outside `OPEN_PATHS` needs ``Authorization: Bearer
    <api_key>``; others get 401 in OpenAI's error shape before the app sees them (no body is read).
    The key is compared in constant time (SHA-256 digests, `hmac.compare_digest`). ``on_refused``, when
    given, is called with ``"missing"`` or ``"invalid"`` for each 401 (the app counts them in /metrics)."""

    def __init__(self, app, api_key: str, on_refused=None):
        check_api_key(api_key)
        self.app, self.on_refused = app, on_refused
        self._digest = hashlib.sha256(api_key.encode("ascii")).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        scheme, _, token = given[0].strip().partition(b" ") if len(given) == 1 else (b"", b"", b"")
        if scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest):
            return await self.app(scope, receive, send)
        if given:
            exc, challenge = Unauthorized("the API key is not valid"), 'Bearer realm="dice-fast", error="invalid_token"'
        else:
            exc = Unauthorized("no API key: send it as the header 'Authorization: Bearer <key>'")
            challenge = 'Bearer realm="dice-fast"'
        if self.on_refused is not None:
            self.on_refused("invalid" if given else "missing")
        await JSONResponse(exc.body(), status_code=401, headers={"WWW-Authenticate": challenge})(scope, receive, send)


def check_api_key(key) -> str:
    """``key`` if it can be an API key (a non-empty string of visible ASCII), else ValueError."""
    if not isinstance(key, str) or not key or not all("!" <= c <= "~" for c in key):
        raise ValueError("an API key must be a non-empty string of visible ASCII characters (no spaces)")
    return key


def _route_path(scope) -> str:
    """The request's path inside this app (without the prefix it is mounted under)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


def _check_content_type(value: str | None) -> None:
    """Accept JSON (``application/json`` or ``*/*+json``, UTF-8), or no Content-Type at all."""
    if value is None:
        return
    media, *params = (part.strip().lower() for part in value.split(";"))
    charset = next((p.split("=", 1)[1].strip('"') for p in params if p.startswith("charset=")), "utf-8")
    if (media != "application/json" and not media.endswith("+json")) or charset not in ("utf-8", "utf8"):
        raise UnsupportedMediaType(f"the body must be JSON in UTF-8 (Content-Type: application/json), not "
                                   f"{value[:100]!r}")


async def _read_body(request, limit: int) -> bytes:
    """The request body, refused with `RequestTooLarge` as soon as its Content-Length or the bytes
    received so far pass ``limit`` (the rest is never read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"the request body has {int(declared)} bytes; the limit is {limit} (max_body_bytes)")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestTooLarge(f"the request body has more than {limit} bytes, the limit (max_body_bytes)")
    return bytes(body)


async def _unless_disconnected(request, work):
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
