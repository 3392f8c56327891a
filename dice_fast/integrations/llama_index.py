"""LlamaIndex: DICE document vectors behind llama-index-core's ``BaseEmbedding``
(``pip install dice-fast[llama-index]``).

    from llama_index.core import Document, VectorStoreIndex
    from dice_fast.integrations.llama_index import DiceEmbedding

    embed = DiceEmbedding()                    # in-process bundled all-MiniLM-L6-v2; or a folder / a DiceEncoder
    docs = [Document(text=t, id_=i) for i, t in zip(ids, long_texts)]
    index = VectorStoreIndex(docs, embed_model=embed)     # one node per whole document: DICE does the chunking
    index.as_retriever(similarity_top_k=3).retrieve("what is the pass key?")

Text embeddings (``get_text_embedding``, ``get_text_embedding_batch``, what indexing calls) are the
engine's ``encode_documents``: chunked, each chunk encoded alone, aggregated. Query embeddings are
``encode_queries``: one model window. ``base_url=`` (and ``api_key=``) use a running ``dice-fast serve``.

Let DICE do the chunking. ``VectorStoreIndex.from_documents`` first splits every document into nodes of
about 1,024 tokens (``Settings.transformations``: a ``SentenceSplitter``), each then embedded on its own,
which undoes what DICE is for; ``transformations=[]`` does not stop it (an empty list means "the
defaults"). Keep whole documents as nodes in one of these ways:

* ``VectorStoreIndex(documents, embed_model=embed)``: documents are nodes; each is embedded whole, ids kept;
* build the nodes yourself: ``VectorStoreIndex([TextNode(text=t, id_=i) ...], embed_model=embed)``;
* ``from_documents(docs, embed_model=embed, transformations=[SentenceSplitter(chunk_size=10**9,
  chunk_overlap=0)])``, or that splitter in an ingestion pipeline: a splitter that never splits.

``DiceRetriever`` retrieves from any dice_fast store (a ``DiceIndex``, a Qdrant or LanceDB store) and
returns each document's evidence passage as a node::

    from dice_fast.integrations.llama_index import DiceRetriever
    DiceRetriever(DiceIndex.from_texts(encoder, long_texts, ids), k=3).retrieve("what is the pass key?")

LlamaIndex embeds a node's metadata with its text (``file_path: ...``); set the documents'
``excluded_embed_metadata_keys`` if the vectors should see the text alone.
"""

from __future__ import annotations

from typing import Any

from ..errors import ArgumentTypeError, require
from ..scoring import DEFAULT_SCORING, check_scoring
from ._common import QueryTooLong, hit_metadata
from ._embedder import LocalEmbedder, embedder, rebuild_arguments
from ._server_client import DiceServerError

require("llama_index.core", extra="llama-index", needed_by="dice_fast.integrations.llama_index")
from llama_index.core.base.embeddings.base import BaseEmbedding  # noqa: E402
from llama_index.core.retrievers import BaseRetriever  # noqa: E402
from llama_index.core.schema import NodeRelationship, NodeWithScore, RelatedNodeInfo, TextNode  # noqa: E402
from pydantic import BaseModel as PydanticModel  # noqa: E402
from pydantic import PrivateAttr  # noqa: E402

__all__ = ["DiceEmbedding", "DiceRetriever", "DiceServerError", "QueryTooLong"]


class DiceEmbedding(BaseEmbedding):
    """llama-index-core ``BaseEmbedding`` over DICE.

    encoder: a `DiceEncoder`, a local model folder, or None (the bundled all-MiniLM-L6-v2); a folder or
        None is loaded with ``options`` (`DiceConfig` fields). base_url / api_key / client_options: a
        running ``dice-fast serve`` instead (see `dice_fast.integrations.langchain.DiceEmbeddings`).
    embed_batch_size: texts per call into the engine (64 by default; DICE packs them itself, so it bounds
        memory; a vector moves only by float32 rounding, about 1e-7, with what is packed beside it).
    BaseEmbedding's own fields (model_name, callback_manager, num_workers, embeddings_cache, rate_limiter)
        are accepted as keywords too; model_name defaults to the model folder's name (or the server's URL).

    ``to_dict()`` / ``to_json()`` (what an ``IngestionPipeline`` cache keys on) carry the DICE settings
    under ``"dice"``: how to build the embedder again (model folder and options, or ``base_url`` and
    ``client_options``; never ``api_key``) and ``"vectors"``, everything that shapes a vector, resolved
    (`dice_fast.integrations._common.vector_settings` and the model folder), so embeddings that give
    other vectors never share a cache key. ``from_dict`` / ``from_json`` build an equal embedding from
    them (pass ``api_key=`` again for a server that needs one); one over a `DiceEncoder` without a folder
    cannot be rebuilt and raises `ArgumentTypeError`.

    Picklable, so ``IngestionPipeline.run(num_workers=N)`` works: each worker process loads the model
    again from its folder with the same options (or calls the same server) when it first embeds. An
    in-process embedding over a `DiceEncoder` that has no folder (built from a model object without
    ``model_path``) cannot be, and pickling it raises a TypeError saying what to pass instead.
    """

    _embedder: Any = PrivateAttr()

    def __init__(self, encoder=None, *, base_url: str | None = None, api_key: str | None = None,
                 client_options: dict | None = None, embed_batch_size: int = 64, **options):
        fields = {name: options.pop(name) for name in list(options) if name in type(self).model_fields}
        source = embedder(encoder, options, base_url=base_url, api_key=api_key, extra="llama-index",
                          **(client_options or {}))
        fields.setdefault("model_name", source.name)
        super().__init__(embed_batch_size=embed_batch_size, **fields)
        self._embedder = source

    @classmethod
    def class_name(cls) -> str:
        return "DiceEmbedding"

    def __getstate__(self) -> dict:
        # llama-index drops a private attribute that fails to pickle (with a warning), which would leave a
        # copy with no embedder at all: fail here instead, saying what to pass
        if isinstance(self._embedder, LocalEmbedder):
            self._embedder.source()
        # llama-index removes an unpicklable field (a callback_manager holding a lock) from the live
        # __dict__ that pydantic hands it: pickle a copy without it, keep it on this object
        fields = dict(self.__dict__)
        state = super().__getstate__()
        state = {**state, "__dict__": dict(state["__dict__"])}
        self.__dict__.update(fields)
        return state

    def __setstate__(self, state: dict) -> None:
        # pydantic's, not llama-index's (which calls __init__ with the fields, i.e. would load a model);
        # a field llama-index dropped as unpicklable (a callback_manager holding a lock) gets its default
        PydanticModel.__setstate__(self, state)
        for name, field in type(self).model_fields.items():
            if name not in self.__dict__:
                self.__dict__[name] = field.get_default(call_default_factory=True, validated_data=dict(self.__dict__))

    def to_dict(self, **kwargs: Any) -> dict:
        """BaseEmbedding's fields, ``class_name`` and ``"dice"``: the embedder's description (see the class)."""
        data = super().to_dict(**kwargs)
        data["dice"] = self._embedder.describe()
        return data

    @classmethod
    def from_dict(cls, data: dict, **kwargs: Any) -> DiceEmbedding:
        """The embedding ``to_dict`` describes (``kwargs`` override its entries, e.g. ``api_key=``);
        `ArgumentTypeError` when it was made over a `DiceEncoder` without a folder."""
        data = {**data, **kwargs}
        data.pop("class_name", None)
        described = data.pop("dice", None)
        if described is None and "encoder" not in data and "base_url" not in data:  # an older version's to_dict
            raise ArgumentTypeError("this dict holds no 'dice' description of the embedder (an older dice_fast's "
                                    "to_dict?): pass encoder= (the model folder) and its options, or base_url=")
        arguments = {} if described is None else rebuild_arguments(described)
        return cls(**{**arguments, **data})

    @property
    def encoder(self):
        """The in-process `DiceEncoder` (None when a server computes the vectors)."""
        return getattr(self._embedder, "encoder", None)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embedder.queries([query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return (await self._embedder.aqueries([query]))[0].tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embedder.documents([text])[0].tolist()

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await self._embedder.adocuments([text]))[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embedder.documents(list(texts)).tolist()

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return (await self._embedder.adocuments(list(texts))).tolist()


class DiceRetriever(BaseRetriever):
    """Retrieve by document, hand over the passage: a llama-index-core retriever over any dice_fast store.

    index: a `dice_fast.DiceIndex`, `QdrantStore` or `LanceStore` keeping its texts (or any object with
        their ``search`` and hits); k: documents per query; scoring: "maxsim" (the default, measured
        best), "dice" or "hybrid"; search_kwargs: more arguments of ``search`` (``alpha`` ...).

    Each hit becomes a ``NodeWithScore``: a ``TextNode`` holding the evidence passage
    (``text[start_char:end_char]``), id ``"{document id}#{chunk}"``, its source document the document id,
    metadata ``{"id", "score", "scoring", "chunk", "start_char", "end_char", "chunk_score"}`` (kept out of
    what an embedding or an LLM sees), and the hit's score.
    """

    def __init__(self, index, k: int = 4, scoring: str = DEFAULT_SCORING, search_kwargs: dict | None = None,
                 **kwargs):
        self.index, self.k, self.scoring = index, k, check_scoring(scoring)
        self.search_kwargs = dict(search_kwargs or {})
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle) -> list[NodeWithScore]:
        hits = self.index.search([query_bundle.query_str], k=self.k, scoring=self.scoring, **self.search_kwargs)[0]
        out = []
        for hit in hits:
            metadata = hit_metadata(hit, self.scoring)
            keys = list(metadata)
            node = TextNode(text=metadata.pop("text"), id_=f"{hit.id}#{hit.chunk}", metadata=metadata,
                            excluded_embed_metadata_keys=keys, excluded_llm_metadata_keys=keys,
                            relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=str(hit.id))})
            out.append(NodeWithScore(node=node, score=float(hit.score)))
        return out
