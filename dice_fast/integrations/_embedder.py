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

The server client is `dice_fast.integrations._server_client` (retries, errors, kept connections).
Imports nothing optional at module level; the HTTP client (httpx, a dependency of both langchain-core
and llama-index-core) is imported when a server is first called.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from ..chunking import check_texts
from ..config import dtype_name
from ..errors import ArgumentTypeError
from ._common import QueryTooLong, as_encoder, in_thread_until_cancelled, jsonable, vector_settings
from ._server_client import CLIENT_OPTIONS, ServerEmbedder


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
    if unknown := sorted(set(client_options) - set(CLIENT_OPTIONS)):
        raise TypeError(f"unknown client_options {unknown}; allowed: {', '.join(CLIENT_OPTIONS)}")
    return ServerEmbedder(base_url, api_key, extra=extra, **client_options)


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
        options["dtype"] = options["dtype"] or dtype_name(enc.dtype)
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
            return {"source": "in-memory", "vectors": jsonable(vectors)}
        return {"source": "local", "model": None if folder is None else os.fspath(folder),
                "options": jsonable(dict(options)), "vectors": jsonable(vectors)}

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



def _gb(max_bytes: int | None) -> float | None:
    return None if max_bytes is None else max_bytes / 1e9
