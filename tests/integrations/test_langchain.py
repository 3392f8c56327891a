"""LangChain with the real langchain-core: ``DiceEmbeddings`` gives the engine's documents / queries (sync
and async), a langchain ``InMemoryVectorStore`` over it finds the planted document of a haystack of long
documents."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("langchain_core", reason="the langchain extra is not installed: pip install -e '.[langchain]'")

from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from dice_fast.integrations.langchain import DiceEmbeddings  # noqa: E402

SHORT = ["A cat sat on the mat.", "Où est la gare ?", "Numbers 12345 and symbols #$%!"]


def test_embeddings_are_the_engines_documents_and_queries(bundled, haystack):
    emb = DiceEmbeddings(bundled)
    assert emb.encoder is bundled
    docs = SHORT + haystack.texts[:1]
    want = bundled.encode_documents(docs)
    np.testing.assert_array_equal(np.asarray(emb.embed_documents(docs), np.float32), want)
    np.testing.assert_array_equal(np.asarray(asyncio.run(emb.aembed_documents(docs)), np.float32), want)
    q = bundled.encode_queries([haystack.query])[0]
    np.testing.assert_array_equal(np.asarray(emb.embed_query(haystack.query), np.float32), q)
    np.testing.assert_array_equal(np.asarray(asyncio.run(emb.aembed_query(haystack.query)), np.float32), q)
    assert emb.embed_documents([]) == []
    with pytest.raises(TypeError, match="use embed_query"):
        emb.embed_documents("one string")
    with pytest.raises(TypeError, match=r"documents\[1\] is NoneType"):  # the engine names the culprit
        emb.embed_documents(["ok", None])


def test_in_memory_vector_store_finds_the_planted_document(bundled, haystack):
    store = InMemoryVectorStore.from_texts(haystack.texts, DiceEmbeddings(bundled), ids=haystack.ids)
    hits = store.similarity_search_with_score(haystack.query, k=3)
    assert [d.id for d, _ in hits][0] == haystack.ids[haystack.target], hits
    assert hits[0][1] > hits[1][1]
    async_hits = asyncio.run(store.asimilarity_search(haystack.query, k=1))
    assert async_hits[0].id == haystack.ids[haystack.target]


def test_bad_arguments_fail_before_loading_anything(bundled):
    with pytest.raises(ValueError, match="base_url must be an http"):
        DiceEmbeddings(base_url="127.0.0.1:8080")
    with pytest.raises(TypeError, match="server's model and options"):
        DiceEmbeddings(bundled, base_url="http://127.0.0.1:1")
    with pytest.raises(TypeError, match="server's model and options"):
        DiceEmbeddings(base_url="http://127.0.0.1:1", chunk_size=128)
    with pytest.raises(TypeError, match="api_key: only with base_url"):
        DiceEmbeddings(api_key="k")
    with pytest.raises(TypeError, match="options"):
        DiceEmbeddings(bundled, chunk_size=128)  # a built encoder has its options
