"""The LangChain and LlamaIndex retrievers over every dice_fast store (DiceIndex, Qdrant local mode,
LanceDB): the same passages, in the same order, as the store's own search; MaxSim by default."""

from __future__ import annotations

import pytest

from dice_fast import DiceIndex
from dice_fast.index import open_store

pytest.importorskip("qdrant_client")
pytest.importorskip("lancedb")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def stores(bundled, haystack, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    index = DiceIndex.from_texts(bundled, haystack.texts, haystack.ids)
    out = {"dice_index": index}
    for name, url in (("qdrant", "qdrant+memory:///hay"), ("lancedb", f"lancedb://{root}/hay")):
        store = open_store(url, encoder=bundled)
        doc_of = [d for d, n in enumerate(index.cu_doc_chunks[1:] - index.cu_doc_chunks[:-1]) for _ in range(n)]
        store.upsert_arrays(index.ids, index.documents, index.chunks, doc_of, index.chunk_start_char,
                            index.chunk_end_char, index.chunk_tokens, texts=haystack.texts)
        out[name] = store
    return out


@pytest.mark.parametrize("name", ["dice_index", "qdrant", "lancedb"])
def test_langchain_retriever_on_any_store(stores, haystack, name):
    pytest.importorskip("langchain_core")
    from dice_fast.integrations.langchain import DiceRetriever

    store = stores[name]
    docs = DiceRetriever(index=store, k=3).invoke(haystack.query)
    hits = stores["dice_index"].search([haystack.query], k=3, scoring="maxsim")[0]
    assert [(d.id, d.page_content, d.metadata["chunk"]) for d in docs] == [(h.id, h.text, h.chunk) for h in hits]
    assert docs[0].id == haystack.ids[haystack.target] and haystack.needle in docs[0].page_content
    assert all(d.metadata["scoring"] == "maxsim" for d in docs)


@pytest.mark.parametrize("name", ["dice_index", "qdrant", "lancedb"])
def test_llama_index_retriever_on_any_store(stores, haystack, name):
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import MetadataMode, NodeRelationship

    from dice_fast.integrations.llama_index import DiceRetriever

    found = DiceRetriever(stores[name], k=3).retrieve(haystack.query)
    hits = stores["dice_index"].search([haystack.query], k=3)[0]
    assert [(n.node.get_content(), n.node.ref_doc_id, n.node.metadata["chunk"]) for n in found] == \
        [(h.text, h.id, h.chunk) for h in hits]
    assert [n.score for n in found] == pytest.approx([h.score for h in hits], abs=1e-5)
    top = found[0].node
    assert top.id_ == f"{hits[0].id}#{hits[0].chunk}" and haystack.needle in top.get_content()
    assert top.get_content(MetadataMode.EMBED) == top.get_content()  # the metadata stays out of embeddings
    assert top.relationships[NodeRelationship.SOURCE].node_id == haystack.ids[haystack.target]
    with pytest.raises(ValueError, match="unknown scoring"):
        DiceRetriever(stores[name], scoring="bm25")
