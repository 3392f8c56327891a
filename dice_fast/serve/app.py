"""The HTTP layer: an ASGI app (FastAPI) over an `AsyncDiceEncoder`, built by `create_app`.

    app = create_app(DiceEncoder.from_pretrained(), max_queue_tokens=200_000)
    uvicorn.run(app, host="127.0.0.1", port=8080)         # or mount it: parent.mount("/dice", app)

Routes: ``POST /v1/embeddings`` (OpenAI-shaped, see `dice_fast.serve.schemas`), ``GET /health``,
``GET /v1/models``, ``GET /metrics`` (Prometheus text). The app only parses, maps the core's errors to
status codes and serialises; batching, limits and encoding live in the core.

Status codes: 200; 413 a request over a size limit; 422 a malformed body; 429 (with ``Retry-After``)
the queue or the concurrency limit is full; 503 shutting down; 499 is logged (never sent) when the client
went away and its unstarted chunks were dropped; 500 only for a failure of the model itself. Error
bodies are OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

This module imports fastapi; ``dice_fast.serve`` imports it only when `create_app` is first used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..matryoshka import truncate
from ..runinfo import model_label
from .batcher import AsyncDiceEncoder
from .errors import InvalidRequest, Overloaded, RequestTooLarge, ServeError, ShuttingDown, internal_error_body
from .metrics import CONTENT_TYPE, ServerMetrics
from .schemas import REQUEST_SCHEMA, embedding_response, parse_embedding_request

log = logging.getLogger("dice_fast.serve")

STATUS = {InvalidRequest: 422, RequestTooLarge: 413, Overloaded: 429, ShuttingDown: 503}
CLIENT_GONE = 499  # nginx's "client closed request": counted in metrics, never sent
_OFF_LOOP_FLOATS = 1 << 16  # responses with more floats than this are serialised in a worker thread


def create_app(encoder, *, model_name: str | None = None, **limits):
    """A FastAPI app serving ``encoder``.

    encoder: a `DiceEncoder` (the app builds an `AsyncDiceEncoder` over it with ``limits``, the keyword
    arguments of `AsyncDiceEncoder`, and closes it at shutdown) or an `AsyncDiceEncoder` you own (then
    pass no limits; several apps may share it). model_name: the name reported in responses and
    ``/v1/models`` (default: the model folder's name).
    """
    if isinstance(encoder, AsyncDiceEncoder):
        if limits:
            raise TypeError(f"limits ({', '.join(limits)}) belong to the AsyncDiceEncoder passed in; set them there")
        core, owned = encoder, False
    else:
        core, owned = AsyncDiceEncoder(encoder, **limits), True
    name = model_name or model_label(core.encoder.spec.name)
    metrics = ServerMetrics(core)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if owned:  # uvicorn has finished the requests in flight by now; drain and stop the worker
            await core.aclose()

    app = FastAPI(title="dice-fast embeddings", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible DICE long-document embeddings.")
    app.state.core, app.state.metrics, app.state.model_name = core, metrics, name

    def error(exc: ServeError) -> JSONResponse:
        status = STATUS.get(type(exc), 422)
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else None
        return JSONResponse(exc.body(), status_code=status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # 404, 405 in OpenAI's shape
        body = {"error": {"message": f"{exc.detail}: {request.method} {request.url.path}",
                          "type": "invalid_request_error", "param": None, "code": str(exc.status_code)}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.post("/v1/embeddings", summary="Embed documents or queries",
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"application/json": {"schema": REQUEST_SCHEMA}}}})
    async def embeddings(request: Request):
        start = time.perf_counter()
        input_type = "unknown"
        try:
            req = parse_embedding_request(await request.body(), core.dim)
            input_type = req.input_type
            embed = core.embed_queries if req.input_type == "query" else core.embed_documents
            out = await _unless_disconnected(request, embed(req.input))
            if out is None:
                metrics.observe_request(input_type, CLIENT_GONE)
                return Response(status_code=CLIENT_GONE)
            vectors = truncate(out.vectors, req.dimensions, core.encoder.config.normalize)
            args = (vectors, out.tokens, name, req.encoding_format)
            if vectors.size > _OFF_LOOP_FLOATS:
                content = await asyncio.get_running_loop().run_in_executor(None, embedding_response, *args)
            else:
                content = embedding_response(*args)
        except ServeError as exc:
            metrics.observe_request(input_type, STATUS.get(type(exc), 422))
            return error(exc)
        except ClientDisconnect:  # gone while sending the body
            metrics.observe_request(input_type, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        except Exception:  # the model failed; never a client's fault
            log.exception("dice_fast.serve: request failed")
            metrics.observe_request(input_type, 500)
            return JSONResponse(internal_error_body(), status_code=500)
        metrics.observe_request(input_type, 200, time.perf_counter() - start, len(req.input), int(out.tokens.sum()))
        return Response(content, media_type="application/json")

    @app.get("/health", summary="Liveness and queue state")
    async def health():
        body = {"status": "shutting_down" if core.closed else "ok", "model": name,
                "queue_tokens": core.tokens_waiting, "requests_in_flight": core.requests_in_flight}
        return JSONResponse(body, status_code=503 if core.closed else 200)

    @app.get("/v1/models", summary="The served model")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "dice-fast", "dimensions": core.dim}]}

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


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
