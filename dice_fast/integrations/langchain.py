"""LangChain: DICE document vectors behind langchain-core's ``Embeddings``, and a retriever that returns
the evidence passage of each retrieved document (``pip install dice-fast[langchain]``).

    from dice_fast.integrations.langchain import DiceEmbeddings, DiceRetriever
    emb = DiceEmbeddings()                                   # in-process, bundled all-MiniLM-L6-v2
    emb = DiceEmbeddings("/models/bge-base", chunk_size=510) # a folder (or a DiceEncoder) and DiceConfig options
    emb = DiceEmbeddings(base_url="http://127.0.0.1:8080", api_key="...")   # a running dice-fast serve
    store = InMemoryVectorStore.from_texts(long_texts, emb)  # whole documents in, one DICE vector each

    retriever = DiceRetriever(index=DiceIndex.from_texts(encoder, long_texts, ids), k=4)
    retriever.invoke("what is the pass key?")                # Documents holding the matching passages
    retriever = DiceRetriever(index=open_store("qdrant://localhost:6333/docs"))  # or any dice_fast store

``embed_documents`` encodes documents (chunked, each chunk encoded alone, chunk vectors aggregated),
``embed_query`` a query (one model window): the engine's ``encode_documents`` / ``encode_queries``,
row for row, except that a query longer than the model window raises `QueryTooLong` (in process as
through a server, which refuses it by default) where ``encode_queries`` cuts it to the window with a
warning. ``DiceRetriever`` encodes its query with the store's ``search``, so it cuts and warns.
Hand LangChain whole documents: DICE does the chunking, so a text splitter in front of it only makes
the chunks smaller than the model's window.

A server refuses token ids; LangChain's own ``OpenAIEmbeddings`` sends them by default: use
``DiceEmbeddings(base_url=...)``, or ``OpenAIEmbeddings(..., check_embedding_ctx_length=False)``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import require
from ..scoring import DEFAULT_SCORING, check_scoring
from ._common import QueryTooLong, hit_metadata
from ._embedder import embedder
from ._server_client import DiceServerError

require("langchain_core", extra="langchain", needed_by="dice_fast.integrations.langchain")
from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from pydantic import Field  # noqa: E402

__all__ = ["DiceEmbeddings", "DiceRetriever", "DiceServerError", "QueryTooLong"]


class DiceEmbeddings(Embeddings):
    """langchain-core ``Embeddings`` over DICE: documents through the engine, queries one window each.

    encoder: a `DiceEncoder`, a local model folder, or None (the bundled all-MiniLM-L6-v2); a folder or
        None is loaded with ``options`` (`DiceConfig` fields: chunk_size, aggregation, device, dtype ...).
    base_url: instead, a running ``dice-fast serve`` (``http://host:port``); api_key is sent as
        ``Authorization: Bearer``; ``client_options``: batch_size, timeout, max_retries, max_retry_seconds (see
        `dice_fast.integrations._server_client.ServerEmbedder`). Server errors raise `DiceServerError`.
    The async methods run in a worker thread (in-process) or over an async HTTP client.
    """

    def __init__(self, encoder=None, *, base_url: str | None = None, api_key: str | None = None,
                 client_options: dict | None = None, **options):
        self._embedder = embedder(encoder, options, base_url=base_url, api_key=api_key, extra="langchain",
                                  **(client_options or {}))

    @property
    def encoder(self):
        """The in-process `DiceEncoder` (None when a server computes the vectors)."""
        return getattr(self._embedder, "encoder", None)

    def __repr__(self) -> str:
        return f"DiceEmbeddings({self._embedder.name!r})"

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """n documents -> n vectors (lists of dim floats), row i of ``encode_documents(texts)``."""
        return self._embedder.documents(_texts(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        """One query -> its vector, ``encode_queries([text])[0]``; `QueryTooLong` for a query longer than
        the model window (``encode_queries`` would cut it)."""
        return self._embedder.queries([_text(text)])[0].tolist()

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return (await self._embedder.adocuments(_texts(texts))).tolist()

    async def aembed_query(self, text: str) -> list[float]:
        return (await self._embedder.aqueries([_text(text)]))[0].tolist()


class DiceRetriever(BaseRetriever):
    """Retrieve by document, hand over the passage: a langchain-core retriever over any dice_fast store.

    index: a `dice_fast.DiceIndex`, a `QdrantStore` or a `LanceStore` (`dice_fast.index.open_store`) that
        keeps its texts (the default of ``DiceIndex.from_texts`` and of the stores' ``add``); any object
        with their ``search(queries, k=, scoring=, **search_kwargs)`` whose hits carry ``id``, ``score``,
        ``chunk``, ``start_char``, ``end_char``, ``chunk_score`` and ``text`` will do.
    A query longer than the model window is cut to it with a warning (the store's ``encode_queries``).
    k: documents per query; scoring: "maxsim" (a document's best chunk; the default, measured best,
        docs/retrieval.md), "dice" (the document vector ranks) or "hybrid" (another raises `OptionError`
        when the retriever is built); search_kwargs: more
        arguments of ``search`` (``alpha``, ``approximate``, ``candidates`` ...).

    ``invoke(query, k=2, scoring="dice", alpha=0.5)`` overrides them for one call (as LangChain's
    standard retriever tests expect; without these, langchain-core dropped ``k`` silently).

    Each hit becomes a ``Document`` whose ``page_content`` is the evidence passage (the chunk of the
    document that best matches the query, ``text[start_char:end_char]``), ``id`` the document's id, and
    ``metadata`` ``{"id", "score", "scoring", "chunk", "start_char", "end_char", "chunk_score"}``.
    """

    index: Any
    k: int = 4
    scoring: str = DEFAULT_SCORING
    search_kwargs: dict = Field(default_factory=dict)

    def __init__(self, **kwargs: Any):
        check_scoring(kwargs.get("scoring", DEFAULT_SCORING))  # OptionError now, as LlamaIndex's retriever does
        super().__init__(**kwargs)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **overrides: Any) -> list[Document]:
        overrides.pop("verbose", None)  # langchain-core's own argument of invoke, passed on with the rest
        overrides = {**overrides.pop("search_kwargs", {}), **overrides}  # invoke(q, search_kwargs={...}) too
        k, scoring = overrides.pop("k", self.k), check_scoring(overrides.pop("scoring", self.scoring))
        hits = self.index.search([_text(query)], k=k, scoring=scoring, **{**self.search_kwargs, **overrides})[0]
        return [_document(hit, scoring) for hit in hits]

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       **overrides: Any) -> list[Document]:
        # langchain-core's default passes no overrides on (ainvoke(q, k=3) raised a TypeError)
        return await asyncio.to_thread(self._get_relevant_documents, query, run_manager=run_manager.get_sync(),
                                       **overrides)


def _document(hit, scoring: str) -> Document:
    metadata = hit_metadata(hit, scoring)
    return Document(page_content=metadata.pop("text"), id=str(hit.id), metadata=metadata)


def _texts(texts) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("embed_documents takes a list of strings, got one string; use embed_query, or wrap it in a list")
    return list(texts)


def _text(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"a query must be a string, got {type(text).__name__}")
    return text
