"""The HTTP layer: an ASGI app (FastAPI) over an `AsyncDiceEncoder`, built by `create_app`.

    app = create_app(DiceEncoder.from_pretrained(), max_queue_tokens=200_000)
    uvicorn.run(app, host="127.0.0.1", port=8080)         # or mount it: parent.mount("/dice", app)

Routes: ``POST /v1/embeddings`` (OpenAI-shaped, see `dice_fast.serve.schemas`), ``POST /v1/evidence``,
``GET /health``, ``GET /v1/models`` (and ``/v1/models/{name}``), ``GET /metrics`` (Prometheus text),
and FastAPI's ``/openapi.json`` (every status code of every route, `dice_fast.serve.openapi`),
``/docs`` and ``/redoc``. The app checks
the Host and the API key (`dice_fast.serve.guards`), takes the request's share of the core (a `Lease`,
held until the response's last byte is handed to the connection), counts the body in as it streams
(`dice_fast.serve.transport`), parses, maps the core's errors to status codes and serialises;
batching, the token limits and encoding live in the core.

With an API key every route but ``/health`` needs ``Authorization: Bearer <key>`` (compared in constant
time), ``/metrics`` and ``/openapi.json`` included; ``/docs`` and ``/redoc`` are off (a browser page
cannot send the key).

Status codes: 200; 400 a malformed body (as OpenAI's API: the ``openai`` client raises
``BadRequestError``) or a Host header the server does not answer to; 401 (with ``WWW-Authenticate:
Bearer``) no key or the wrong one; 408 a body slower than ``read_timeout``; 413 a request over a size
limit (body bytes, inputs, characters, tokens, response floats); 415 a body not declared as JSON; 429
(with ``Retry-After``) the queue or the concurrency limit is full; 503 ``shutting_down`` while shutting
down (also for a request still in flight past the server's graceful timeout, with ``Connection:
close``); 499 is logged (never sent) when the client went away and its unstarted chunks were dropped; 503 ``out_of_memory`` (naming the input) when one of its chunks ran out
of memory alone, 503 ``unhealthy`` when the worker has stopped; 504 past ``request_timeout``; 500
``non_finite_output`` (naming the input) when the model's output for it holds NaN or an infinity, and
500 for another failure of the model itself. Error bodies are OpenAI's ``{"error": {"message", "type",
"param", "code"}}``; an error sent before the body was read whole also closes the connection (the rest
of the body is never read).

This module imports fastapi; ``dice_fast.serve`` imports it only when `create_app` is first used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..errors import one_line
from ..matryoshka import truncate
from ..runinfo import model_label
from . import openapi as oa
from .batcher import AsyncDiceEncoder
from .errors import (DeadlineExceeded, InvalidRequest, ModelNotFound, ModelOutputNotFinite, OutOfMemory, Overloaded,
                     RequestTooLarge, ServeError, ShuttingDown, Unauthorized, Unhealthy, UnsupportedMediaType,
                     internal_error_body, quote, was_logged)
from .evidence import add_evidence_route
from .guards import BearerAuth, HostGuard, OriginForm, check_api_key
from .limits import check_limits, default_max_body_bytes
from .server import SERVER_DEFAULTS
from .metrics import CONTENT_TYPE, ServerMetrics
from .schemas import embedding_response, parse_embedding_request
from .transport import LeasedResponse, RequestTimeout, check_content_type, read_body, unless_disconnected

log = logging.getLogger("dice_fast.serve")

STATUS = {InvalidRequest: 400, UnsupportedMediaType: 415, RequestTooLarge: 413, Overloaded: 429, ShuttingDown: 503,
          Unauthorized: 401, OutOfMemory: 503, Unhealthy: 503, DeadlineExceeded: 504, RequestTimeout: 408,
          ModelNotFound: 404, ModelOutputNotFinite: 500}
CLIENT_GONE = 499  # nginx's "client closed request": counted in metrics, never sent
_OFF_LOOP_FLOATS = 1 << 16  # responses with more floats than this are serialised in a worker thread
_OFF_LOOP_BYTES = 1 << 16  # request bodies longer than this are parsed in a worker thread
_BODY_READ = "dice_fast.body_read"  # scope key: the request body was read whole


def create_app(encoder, *, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int | None = None, allowed_hosts=None,
               read_timeout: float | None = SERVER_DEFAULTS["read_timeout"],
               shutdown_timeout: float | None = None, **limits):
    """A FastAPI app serving ``encoder``.

    encoder: a `DiceEncoder` (the app builds an `AsyncDiceEncoder` over it with ``limits``, the keyword
    arguments of `AsyncDiceEncoder`, and closes it at shutdown) or an `AsyncDiceEncoder` you own (then
    pass no limits; several apps may share it). model_name: the name reported in responses and
    ``/v1/models`` (default: the model folder's name). api_key: when given, every route but ``/health``
    needs ``Authorization: Bearer <api_key>`` (401 otherwise) and the /docs and /redoc pages are off.
    max_body_bytes: a longer request body gets 413 as soon as its Content-Length or its bytes so far
    show it (default: 8 per token of the core's ``max_queue_tokens``; see `dice_fast.serve.limits`).
    allowed_hosts: the ``Host`` names and addresses answered (`dice_fast.serve.guards.allowed_hosts`
    builds them for a bound address; ``["*"]``: any); others get 400. None (the default for an app you
    mount in your own server): no check. read_timeout: seconds a request body may take to arrive
    (408 past it; None: no bound; default 30, as ``dice-fast serve --read-timeout``). shutdown_timeout:
    seconds the app's shutdown waits for the worker to finish the forward it is in (a warm-up, a batch
    whose requests are gone), then leaves it (None, for an app mounted in a server of your own: as long as
    it takes; ``dice-fast serve`` passes its ``--graceful-timeout``, 30).
    """
    if isinstance(encoder, AsyncDiceEncoder):
        if limits:
            raise TypeError(f"limits ({', '.join(limits)}) belong to the AsyncDiceEncoder passed in; set them there")
        core, owned = encoder, False
    else:
        core, owned = AsyncDiceEncoder(encoder, **limits), True
    check_limits(max_body_bytes=max_body_bytes, read_timeout=read_timeout)
    # the app holds its core and metrics (app.state); everything it registers reaches them weakly: FastAPI
    # keeps every route function it has seen in module-level caches (4,096 entries), and through closures
    # over the core each app made in a process kept its core, chunk cache and model alive, served or not
    held, core = core, weakref.proxy(core)
    body_limit = max_body_bytes or default_max_body_bytes(core.max_queue_tokens)
    name = model_name or model_label(core.encoder.spec.name)
    held_metrics = ServerMetrics(core)
    metrics = weakref.proxy(held_metrics)
    created = int(time.time())
    documented = {"keyed": api_key is not None, "host_checked": allowed_hosts is not None}
    embeddings_schema, evidence_schema = oa.request_schemas(core)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        core.start()  # the worker runs a warm-up forward; /health is 503 "starting" until it has
        yield
        if owned and not await core.aclose(shutdown_timeout):  # uvicorn has finished the requests in flight
            log.warning("dice_fast.serve: the worker was still in a forward after %s s; shutting down without it",
                        shutdown_timeout)
            app.state.worker_left = True  # `dice-fast serve` then ends the process without joining it

    pages = {"docs_url": None, "redoc_url": None} if api_key is not None else {}
    app = FastAPI(title="dice-fast embeddings", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible DICE long-document embeddings.", **pages)
    app.router.redirect_slashes = False  # "/v1/embeddings/": a 404 that closes, not a 307 reading the body
    app.state.core, app.state.metrics, app.state.model_name = held, held_metrics, name
    app.state.max_body_bytes = body_limit
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=check_api_key(api_key), on_refused=metrics.observe_unauthorized)
    if allowed_hosts is not None:  # before the key: a page re-bound to this address learns nothing, key or not
        app.add_middleware(HostGuard, allowed=list(allowed_hosts), on_refused=metrics.observe_wrong_host)
    app.add_middleware(OriginForm)  # before the Host check: an absolute-form target's authority is the Host

    def closing(request: Request, headers: dict) -> dict:
        """``headers``, with ``Connection: close`` for a request whose body was not read whole: the rest
        of it is never read (a POST no route takes was read whole, and thrown away)."""
        if request.method not in ("GET", "HEAD") and not request.scope.get(_BODY_READ):
            headers["Connection"] = "close"
        return headers

    def error(exc: ServeError, request: Request) -> JSONResponse:
        status = STATUS.get(type(exc), 400)
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else {}
        return JSONResponse(exc.body(), status_code=status, headers=closing(request, headers))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # 404, 405 in OpenAI's shape
        metrics.observe_unrouted(exc.status_code)
        body = {"error": {"message": f"{exc.detail}: {quote(request.method)} {quote(request.url.path)}",
                          "type": "invalid_request_error", "param": None, "code": str(exc.status_code)}}
        return JSONResponse(body, status_code=exc.status_code,
                            headers=closing(request, dict(getattr(exc, "headers", None) or {})))

    async def read_request(request: Request, parse, *args):
        """``parse(body, *args)`` of the request's body, once its content type (and encoding) is checked
        and its bytes, counted as they stream in, are within the body limit (parsed off the event loop
        when large)."""
        check_content_type(request.headers.get("content-type"), request.headers.get("content-encoding"))
        body = await read_body(request, body_limit, read_timeout)
        request.scope[_BODY_READ] = True
        if len(body) > _OFF_LOOP_BYTES:
            return await asyncio.get_running_loop().run_in_executor(None, parse, body, *args)
        return parse(body, *args)

    async def answer(request: Request, label: str, handle) -> Response:
        """The routes' shared frame. Takes the request's `Lease` (its share of the core) first;
        ``handle(labels, lease)`` returns (JSON bytes, inputs, tokens), or None when the client has gone,
        and may set ``labels[0]`` (the metrics' input type) once it knows it. The lease is released when
        the response's last byte is handed to the connection, or at once for an error. A `ServeError` is
        answered in OpenAI's shape, a client gone gets 499 (counted, never sent), any other error 500
        (logged: the model failed, never the client's fault); each is counted in /metrics."""
        start, labels, lease = time.perf_counter(), [label], None
        try:
            lease = core.lease()
            result = await handle(labels, lease)
        except ServeError as exc:
            _release(lease)
            metrics.observe_request(labels[0], STATUS.get(type(exc), 400))
            return error(exc, request)
        except ClientDisconnect:  # gone while sending the body
            result = None
        except asyncio.CancelledError:
            _release(lease)
            if not core.draining:
                raise
            return shut_down(labels[0])
        except BaseException as exc:
            _release(lease)
            if not isinstance(exc, Exception):
                raise
            if was_logged(exc):  # the worker logged it once for its batch
                log.error("dice_fast.serve: %s request failed: %s", labels[0], one_line(exc))
            else:
                log.exception("dice_fast.serve: %s request failed", labels[0])
            metrics.observe_request(labels[0], 500)
            return JSONResponse(internal_error_body(), status_code=500)
        if result is None:
            _release(lease)
            metrics.observe_request(labels[0], CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        content, inputs, tokens = result
        metrics.observe_request(labels[0], 200, time.perf_counter() - start, inputs, tokens)
        return LeasedResponse(content, lease)

    def shut_down(label: str) -> Response:
        """The answer to a request cancelled because the server is shutting down (uvicorn cancels the
        requests still in flight past its graceful timeout) before its response started: 503
        ``shutting_down``, closing the connection. The cancellation has done its work (the request's
        unrun chunks are dropped, its share released); the response is sent in its place."""
        task = asyncio.current_task()
        if task is not None and hasattr(task, "uncancel"):  # Python 3.11+
            task.uncancel()
        metrics.observe_request(label, 503)
        exc = ShuttingDown("the server is shutting down and the request did not finish within its graceful "
                           "timeout; retry")
        return JSONResponse(exc.body(), status_code=503, headers={"Connection": "close"})

    async def serialise(make, floats: int, *args) -> bytes:
        """``make(*args)``, in a worker thread when the response holds more than `_OFF_LOOP_FLOATS` floats."""
        if floats > _OFF_LOOP_FLOATS:
            return await asyncio.get_running_loop().run_in_executor(None, make, *args)
        return make(*args)

    @app.post("/v1/embeddings", summary="Embed documents or queries",
              responses=oa.responses(oa.EMBEDDING_RESPONSE, oa.POST_ERRORS, **documented),
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"application/json": {"schema": embeddings_schema}}}})
    async def embeddings(request: Request):
        async def handle(labels, lease):
            req = await read_request(request, parse_embedding_request, core.dim)
            labels[0] = req.input_type
            if req.input_type == "query":
                work = core.embed_queries(req.input, lease=lease, width=req.dimensions)
            else:
                work = core.embed_documents(req.input, return_chunks=req.return_chunks, lease=lease,
                                            width=req.dimensions, strategy=req.strategy)
            out = await unless_disconnected(request, work)
            if out is None:
                return None
            vectors = truncate(out.vectors, req.dimensions, core.encoder.config.normalize)
            chunks = out.chunks
            if chunks is not None and req.dimensions is not None:
                chunks = replace(chunks, chunks=truncate(chunks.chunks, req.dimensions, core.encoder.normalize_chunks))
            floats = vectors.size + (chunks.chunks.size if chunks is not None else 0)
            content = await serialise(embedding_response, floats, vectors, out.tokens, name, req.encoding_format,
                                      out.truncated, chunks)
            return content, len(req.input), int(out.tokens.sum())

        return await answer(request, "unknown", handle)

    add_evidence_route(app, core, name, read_request, answer, serialise, evidence_schema,
                       oa.responses(oa.EVIDENCE_RESPONSE, oa.POST_ERRORS, **documented))

    health_doc = oa.responses(oa.HEALTH_RESPONSE, host_checked=documented["host_checked"], keyed=False,
                              ok_status="ready")
    health_doc[503] = {"description": "starting, draining or unhealthy (see status and detail)",
                       "content": {"application/json": {"schema": oa.HEALTH_RESPONSE}}}

    @app.get("/health", summary="Readiness and queue state", responses=health_doc)
    async def health():  # 200 "ok"; 503 "starting" (no warm-up yet), "draining" (SIGTERM), "unhealthy"
        if not core.closed:
            core.start()  # a mounted app gets no lifespan: its first probe starts the worker and warm-up
        status, detail = core.health
        body = {"status": status, "model": name, "queue_tokens": core.tokens_waiting,
                "requests_in_flight": core.requests_in_flight}
        if detail:
            body["detail"] = detail
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models", summary="The served model", responses=oa.responses(oa.MODELS_RESPONSE, **documented))
    async def models():
        return {"object": "list", "data": [served()]}

    @app.get("/v1/models/{model:path}", summary="The served model, by its name (OpenAI's models.retrieve)",
             responses=oa.responses(oa.MODEL_RESPONSE, (404,), **documented))
    async def model(model: str, request: Request):
        if model != name:
            return error(ModelNotFound(f"the model {quote(model)!r} is not served here; this server serves "
                                       f"{quote(name)!r}", "model"), request)
        return served()

    def served() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "dice-fast", "dimensions": core.dim}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse,
             responses=oa.responses(None, ok_type="text/plain", ok_status="Prometheus text format 0.0.4",
                                    **documented))
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    for route in list(app.routes):  # HEAD wherever GET (RFC 9110 9.1: it was 405); not in the OpenAPI document
        if isinstance(route, APIRoute) and route.methods == {"GET"}:
            app.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False,
                              response_class=route.response_class)
    generated = app.openapi

    def openapi() -> dict:
        return oa.without_unsent_422(generated())

    app.openapi = openapi
    return app


def _release(lease) -> None:
    if lease is not None:
        lease.release()
