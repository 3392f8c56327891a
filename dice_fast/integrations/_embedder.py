"""Where the LangChain and LlamaIndex adapters get their vectors: the engine in this process, or a running
``dice-fast serve`` over HTTP. Both give (n, dim) float32 rows equal to the engine's
``encode_documents`` / ``encode_queries`` of the same texts, to float32 rounding (about 1e-7: a text's
vector moves that much with what else is packed into its forward, in-process or in the server, which
packs chunks of concurrent requests together; the server's float32 values arrive unchanged, in base64).

    emb = embedder(None, {}, base_url=None)                          # the bundled model, in-process
    emb = embedder(None, {}, base_url="http://127.0.0.1:8080", api_key="s3cret")
    emb.documents(texts); emb.queries(texts); await emb.adocuments(texts); await emb.aqueries(texts)

A query longer than the model window is refused alike in-process and through a server: `QueryTooLong`
naming its position in the call (through a server, as `ServerQueryTooLong`, which is also a
`DiceServerError` with status 413: what ``dice-fast serve`` answers by default). A server started with
``--auto-truncate`` cuts such a query to the window instead, as the engine's own ``encode_queries``
does; the client then warns naming the queries cut, as the engine does.

The server client retries what waiting can fix (429 queue full, 503, connection failures; `RetryPolicy`:
bounded tries and time, ``Retry-After`` honoured, jitter) and raises `DiceServerError` for everything
else, transport errors included (``status`` None: no response).

Imports nothing optional at module level; the HTTP client (httpx, a dependency of both langchain-core
and llama-index-core) is imported when a server is first called.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from ..chunking import check_texts
from ..errors import ArgumentTypeError, require
from ._common import as_encoder, in_thread_until_cancelled, vector_settings
from ._http import Connections
from ._retry import RetryPolicy

_KINDS = {"documents": "document", "queries": "query"}


def embedder(encoder, options: dict, *, base_url: str | None = None, api_key: str | None = None,
             extra: str, **client_options):
    """A `LocalEmbedder` over ``encoder`` (a `DiceEncoder`, a model folder or None; see `as_encoder`) or,
    when ``base_url`` is given, a `ServerEmbedder` (``client_options``: its keyword arguments)."""
    if base_url is None:
        stray = (["api_key"] if api_key is not None else []) + sorted(client_options)
        if stray:
            raise TypeError(f"{', '.join(stray)}: only with base_url (a running dice-fast serve)")
        from dice_fast import DiceEncoder

        source = None if isinstance(encoder, DiceEncoder) else (None if encoder is None else os.fspath(encoder), options)
        return LocalEmbedder(as_encoder(encoder, options), source)
    if encoder is not None or options:
        raise TypeError("with base_url the server's model and options are used: pass no encoder or DICE options "
                        f"(got {'an encoder' if encoder is not None else sorted(options)})")
    return ServerEmbedder(base_url, api_key, extra=extra, **client_options)


def _jsonable(value):
    """``value`` with paths as strings and anything JSON has no type for (a ``torch.device``) as its
    ``str``: a description goes through ``json.dumps`` (LlamaIndex's ``to_json``, its cache keys)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def rebuild_arguments(described: dict) -> dict:
    """The arguments of `embedder` (``encoder`` and the options, or ``base_url`` and ``client_options``)
    that build again an embedder from its ``describe()``; `ArgumentTypeError` for one over an in-memory
    encoder (no folder to load it from) or a description of another shape."""
    source = described.get("source") if isinstance(described, dict) else None
    if source == "local":
        return {"encoder": described["model"], **described["options"]}
    if source == "server":
        return {"base_url": described["base_url"], "client_options": dict(described["client_options"])}
    if source == "in-memory":
        raise ArgumentTypeError(
            "cannot rebuild this embedder: it was made over a DiceEncoder built from a model object, which no "
            "description can load again; build it from the model folder and options (e.g. "
            "DiceEmbedding('/models/bge', chunk_size=510)) or a running server (base_url=...) to make it serialisable")
    raise ArgumentTypeError(f"not a dice_fast embedder description: {described!r}")


class LocalEmbedder:
    """The engine in this process. ``documents`` / ``queries``: n strings -> (n, dim) float32; the
    async twins run them in a worker thread (a `DiceEncoder` may encode from several threads at once).

    Picklable (for process pools: LlamaIndex's ``IngestionPipeline.run(num_workers=...)``, multiprocessing):
    what is pickled is how to load the encoder, ``source`` = (model folder or None, options), and the
    copy loads it when first used. An encoder passed in is loaded again from its ``model_path`` with its
    options; one with no folder cannot be, and pickling it raises `ArgumentTypeError` saying what to pass.
    """

    def __init__(self, encoder, source: tuple | None = None):
        self._encoder, self._source, self._lock = encoder, source, threading.Lock()

    @property
    def encoder(self):
        """The `DiceEncoder` (loaded here on first use in a copy made by unpickling)."""
        if self._encoder is None:
            with self._lock:
                if self._encoder is None:
                    self._encoder = as_encoder(*self._source)
        return self._encoder

    def source(self) -> tuple:
        """(model folder or None for the bundled model, options) that load this encoder again, in
        another process; `ArgumentTypeError` for an encoder that has no folder to load it from."""
        if self._source is not None:
            folder, options = self._source
            cache = options.get("cache")
            if cache is not None and not isinstance(cache, (str, os.PathLike)):  # an open ChunkCache
                options = {**options, "cache": str(cache.folder), "cache_max_gb": _gb(cache.max_bytes)}
            return folder, options
        enc = self._encoder
        if enc.model_path is None:
            raise ArgumentTypeError(
                "cannot pickle an embedder over a DiceEncoder built from a model object: another process has no "
                "folder to load it from; pass the model folder and options instead of the encoder (e.g. "
                "DiceEmbedding('/models/bge', chunk_size=510)), build the encoder with "
                "DiceEncoder.from_pretrained(folder) or DiceEncoder(model, tokenizer, model_path=folder) for a model "
                "saved there, or use a running server (base_url=...)")
        from dice_fast import DiceConfig

        options = {k: getattr(enc.config, k) for k in DiceConfig.field_names()}
        # where and at what precision it runs now (options left None would pick them anew, e.g. CUDA)
        options["device"] = options["device"] or str(enc.device)
        options["dtype"] = options["dtype"] or str(enc.dtype).replace("torch.", "")
        if enc.cache is not None:
            options.update(cache=str(enc.cache.cache.folder), cache_max_gb=_gb(enc.cache.cache.max_bytes))
        if type(enc.model).__module__.startswith("transformers_modules"):  # loaded with the folder's own code
            options["trust_remote_code"] = True
        return enc.model_path, options

    def describe(self) -> dict:
        """JSON-able: ``{"source": "local", "model": folder or None, "options": {...}, "vectors": {...}}``
        (``rebuild_arguments`` builds it again from this), or ``{"source": "in-memory", "vectors": {...}}``
        for an encoder with no folder. ``vectors``: the model (its folder, absolute) and `vector_settings`,
        so embedders whose vectors differ never describe themselves alike."""
        enc = self.encoder
        name = str(enc.model_path or enc.spec.name)
        model = str(Path(name).resolve()) if Path(name).is_dir() else name
        vectors = {"model": model, **vector_settings(enc)}
        try:
            folder, options = self.source()
        except ArgumentTypeError:
            return {"source": "in-memory", "vectors": _jsonable(vectors)}
        return {"source": "local", "model": None if folder is None else os.fspath(folder),
                "options": _jsonable(dict(options)), "vectors": _jsonable(vectors)}

    def __getstate__(self) -> dict:
        return {"source": self.source()}

    def __setstate__(self, state: dict) -> None:
        self._encoder, self._source, self._lock = None, state["source"], threading.Lock()

    def __copy__(self):
        return self  # nothing of it changes: copies share the loaded encoder (which many threads may use)

    def __deepcopy__(self, memo):
        return self

    @property
    def name(self) -> str:
        from ..runinfo import model_label

        return model_label(self.encoder.spec.name)

    def documents(self, texts: list[str], progress=None) -> np.ndarray:
        return self.encoder.encode_documents(texts, progress=progress)

    def queries(self, texts: list[str], progress=None) -> np.ndarray:
        """(n, dim) float32; `QueryTooLong` for a query longer than the model window (as a server refuses it),
        `ArgumentTypeError` naming a query that is no string."""
        texts = check_texts(texts, "queries")
        enc = self.encoder
        used = enc.max_tokens_used("queries")
        lengths = enc.tokenize(texts, what="queries", spans=False, kind="queries").lengths  # thread-safe (the engine's lock)
        if (over := np.flatnonzero(lengths > used)).size:
            i = int(over[0])
            raise QueryTooLong(f"query {i} of this call has {int(lengths[i])} tokens, more than the model window "
                               f"holds ({used} besides special tokens and prefix); shorten it", i)
        return enc.encode_queries(texts, progress=progress)

    async def adocuments(self, texts: list[str]) -> np.ndarray:
        return await in_thread_until_cancelled(lambda progress: self.documents(texts, progress))

    async def aqueries(self, texts: list[str]) -> np.ndarray:
        return await in_thread_until_cancelled(lambda progress: self.queries(texts, progress))


class QueryTooLong(ValueError):
    """A query longer than the model window, refused in-process and through a server alike; ``index``:
    its position among the texts of the call."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


class DiceServerError(RuntimeError):
    """A running ``dice-fast serve`` refused or failed a request, or could not be reached; ``status`` is
    its HTTP status (None: no response came, e.g. a refused connection or a timeout); ``param``: the
    field the server blamed (``"input[7]"``, ``"dimensions"`` ...; None when it named none). An input is
    named by its position in the whole call, in ``param`` and in the message alike."""

    def __init__(self, message: str, status: int | None, param: str | None = None):
        super().__init__(message)
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
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
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

    def describe(self) -> dict:
        """JSON-able ``{"source": "server", "base_url": ..., "client_options": {...}}`` (no api_key: a
        description may be logged or saved); ``rebuild_arguments`` builds it again from this."""
        return {"source": "server", "base_url": self.base_url, "client_options": _jsonable(dict(self.client_options))}

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
        client = await self._connections.for_loop(httpx)
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
                await asyncio.sleep(wait)
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


def _gb(max_bytes: int | None) -> float | None:
    return None if max_bytes is None else max_bytes / 1e9


def _in_call(text: str, lo: int) -> str:
    """``text`` with every ``input[i]`` (a position in one request, whose first input is the call's
    ``lo``) renamed ``input[lo + i]``, the position in the whole call."""
    return re.sub(r"\binput\[(\d+)\]", lambda m: f"input[{lo + int(m.group(1))}]", text)


def _stack(rows: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)
