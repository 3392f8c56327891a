"""Where the LangChain and LlamaIndex adapters get their vectors: the engine in this process, or a running
``dice-fast serve`` over HTTP. Both give (n, dim) float32 rows equal to the engine's
``encode_documents`` / ``encode_queries`` of the same texts (the server returns them bit for bit).

    emb = embedder(None, {}, base_url=None)                          # the bundled model, in-process
    emb = embedder(None, {}, base_url="http://127.0.0.1:8080", api_key="s3cret")
    emb.documents(texts); emb.queries(texts); await emb.adocuments(texts); await emb.aqueries(texts)

Imports nothing optional at module level; the HTTP client (httpx, a dependency of both langchain-core
and llama-index-core) is imported when a server is first called.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np

from ._common import as_encoder, require

_KINDS = {"documents": "document", "queries": "query"}


def embedder(encoder, options: dict, *, base_url: str | None = None, api_key: str | None = None,
             extra: str, **client_options):
    """A `LocalEmbedder` over ``encoder`` (a `DiceEncoder`, a model folder or None; see `as_encoder`) or,
    when ``base_url`` is given, a `ServerEmbedder` (``client_options``: its keyword arguments)."""
    if base_url is None:
        stray = (["api_key"] if api_key is not None else []) + sorted(client_options)
        if stray:
            raise TypeError(f"{', '.join(stray)}: only with base_url (a running dice-fast serve)")
        return LocalEmbedder(as_encoder(encoder, options))
    if encoder is not None or options:
        raise TypeError("with base_url the server's model and options are used: pass no encoder or DICE options "
                        f"(got {'an encoder' if encoder is not None else sorted(options)})")
    return ServerEmbedder(base_url, api_key, extra=extra, **client_options)


class LocalEmbedder:
    """The engine in this process. ``documents`` / ``queries``: n strings -> (n, dim) float32; the
    async twins run them in a worker thread (a `DiceEncoder` may encode from several threads at once)."""

    def __init__(self, encoder):
        self.encoder = encoder

    @property
    def name(self) -> str:
        from ..runinfo import model_label

        return model_label(self.encoder.spec.name)

    def documents(self, texts: list[str]) -> np.ndarray:
        return self.encoder.encode_documents(texts)

    def queries(self, texts: list[str]) -> np.ndarray:
        return self.encoder.encode_queries(texts)

    async def adocuments(self, texts: list[str]) -> np.ndarray:
        return await asyncio.to_thread(self.documents, texts)

    async def aqueries(self, texts: list[str]) -> np.ndarray:
        return await asyncio.to_thread(self.queries, texts)


class DiceServerError(RuntimeError):
    """A running ``dice-fast serve`` refused or failed a request; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ServerEmbedder:
    """A running ``dice-fast serve`` (or any server of its OpenAI-shaped API with ``input_type``).

    base_url: ``http://host:port`` (a trailing ``/v1`` is accepted); api_key: sent as
    ``Authorization: Bearer <key>`` when given; batch_size: inputs per request (the server packs
    requests together, so this bounds request size, not speed); timeout: seconds per request;
    max_retries: times a request answered 429 (queue full) is retried after the server's
    ``Retry-After``. Responses are requested in base64 (exact float32). Errors raise `DiceServerError`
    with the server's message and the call's positions of the inputs of the failed request.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, batch_size: int = 64, timeout: float = 300.0,
                 max_retries: int = 3, extra: str = "serve"):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        root = base_url.rstrip("/")
        self.url = (root[:-3] if root.endswith("/v1") else root) + "/v1/embeddings"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.batch_size, self.timeout, self.max_retries, self._extra = batch_size, timeout, max_retries, extra

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
            body = json.dumps({"input": batch, "input_type": _KINDS[kind], "encoding_format": "base64"})
            yield lo, len(batch), body.encode("utf-8")

    def _run(self, texts, kind: str) -> np.ndarray:
        httpx = require("httpx", self._extra)
        rows = []
        with httpx.Client(timeout=self.timeout) as client:
            for lo, n, body in self._batches(texts, kind):
                for attempt in range(self.max_retries + 1):
                    response = client.post(self.url, content=body, headers=self.headers)
                    wait = self._retry_after(response, attempt)
                    if wait is None:
                        break
                    time.sleep(wait)
                rows.append(self._vectors(response, lo, n))
        return _stack(rows)

    async def _arun(self, texts, kind: str) -> np.ndarray:
        httpx = require("httpx", self._extra)
        rows = []
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            for lo, n, body in self._batches(texts, kind):
                for attempt in range(self.max_retries + 1):
                    response = await client.post(self.url, content=body, headers=self.headers)
                    wait = self._retry_after(response, attempt)
                    if wait is None:
                        break
                    await asyncio.sleep(wait)
                rows.append(self._vectors(response, lo, n))
        return _stack(rows)

    def _retry_after(self, response, attempt: int) -> float | None:
        """Seconds to wait before retrying a 429 (at most 30), or None: use this response."""
        if response.status_code != 429 or attempt >= self.max_retries:
            return None
        try:
            return min(max(float(response.headers.get("Retry-After", 1)), 0.0), 30.0)
        except ValueError:
            return 1.0

    def _vectors(self, response, lo: int, n: int) -> np.ndarray:
        """(n, dim) float32 from a response to the inputs ``lo .. lo + n - 1`` of the call."""
        where = f"inputs {lo}..{lo + n - 1} of this call" if n > 1 else f"input {lo} of this call"
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code != 200:
            error = body.get("error") if isinstance(body, dict) else None
            message = error.get("message") if isinstance(error, dict) else response.text[:300]
            raise DiceServerError(f"{self.url} answered {response.status_code} for {where}: {message}",
                                  response.status_code)
        try:
            data = sorted(body["data"], key=lambda d: d["index"])
            rows = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
        except (TypeError, KeyError, ValueError) as exc:
            raise DiceServerError(f"{self.url} sent a malformed response for {where}: {exc!r}", 200) from None
        if len(rows) != n:
            raise DiceServerError(f"{self.url} returned {len(rows)} vectors for {n} inputs ({where})", 200)
        return rows.astype(np.float32)


def _stack(rows: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)
