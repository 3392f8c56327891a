"""LangChain with the real langchain-core: ``DiceEmbeddings`` gives the engine's documents / queries (sync
and async), a langchain ``InMemoryVectorStore`` over it finds the planted document of a haystack of long
documents, and ``DiceRetriever`` over a ``DiceIndex`` returns that document with the planted passage."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("langchain_core", reason="the langchain extra is not installed: pip install -e '.[langchain]'")

from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from dice_fast.integrations.langchain import DiceEmbeddings, DiceRetriever  # noqa: E402

SHORT = ["A cat sat on the mat.", "Où est la gare ?", "Numbers 12345 and symbols #$%!"]


def test_embeddings_are_the_engines_documents_and_queries(bundled, haystack):
    emb = DiceEmbeddings(bundled)
    assert emb.encoder is bundled
    docs = SHORT + [haystack.texts[0][:1500]]  # the last one 2 chunks long
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


@pytest.fixture(scope="module")
def index(bundled, haystack):
    from dice_fast import DiceIndex

    return DiceIndex.from_texts(bundled, haystack.texts, ids=haystack.ids)


@pytest.mark.parametrize("scoring", ["dice", "maxsim", "hybrid"])
def test_retriever_returns_the_planted_passage(index, haystack, scoring):
    retriever = DiceRetriever(index=index, k=3, scoring=scoring)
    docs = retriever.invoke(haystack.query)
    assert [d.id for d in docs][0] == haystack.ids[haystack.target], [(d.id, d.metadata) for d in docs]
    top, text = docs[0], haystack.texts[haystack.target]
    assert haystack.needle in top.page_content and len(top.page_content) < len(text) // 2  # a passage, not the document
    m = top.metadata
    assert text[m["start_char"]:m["end_char"]] == top.page_content
    assert m["id"] == top.id and m["scoring"] == scoring and m["chunk"] >= 0
    assert [d.metadata["score"] for d in docs] == sorted((d.metadata["score"] for d in docs), reverse=True)
    hits = index.search([haystack.query], k=3, scoring=scoring)[0]  # the metadata is the hit, nothing else
    assert [(d.id, d.metadata["score"], d.metadata["chunk"], d.metadata["start_char"], d.metadata["end_char"],
             d.metadata["chunk_score"]) for d in docs] == \
        [(h.id, h.score, h.chunk, h.start_char, h.end_char, h.chunk_score) for h in hits]
    again = asyncio.run(retriever.ainvoke(haystack.query))
    assert [(d.id, d.page_content) for d in again] == [(d.id, d.page_content) for d in docs]


def test_invoke_overrides_k_scoring_and_search_arguments_for_one_call(index, haystack):
    """langchain-tests' ``test_invoke_with_k_kwarg``: ``invoke(q, k=1)`` gives 1 document (langchain-core
    dropped ``k`` and the retriever gave its 4); ainvoke too (its default passed nothing on)."""
    retriever = DiceRetriever(index=index, k=3)
    assert len(retriever.invoke(haystack.query, k=1)) == 1 and len(retriever.invoke(haystack.query)) == 3
    docs = asyncio.run(retriever.ainvoke(haystack.query, k=2, scoring="dice"))
    assert len(docs) == 2 and {d.metadata["scoring"] for d in docs} == {"dice"} and retriever.scoring == "maxsim"
    hybrid = retriever.invoke(haystack.query, scoring="hybrid", alpha=1.0, k=2)  # alpha 1: the document vector's rank
    assert [d.id for d in hybrid] == [h.id for h in index.search([haystack.query], k=2, scoring="hybrid", alpha=1.0)[0]]
    nested = retriever.invoke(haystack.query, scoring="hybrid", search_kwargs={"alpha": 1.0}, k=2)
    assert [d.id for d in nested] == [d.id for d in hybrid]
    with pytest.raises(ValueError, match="scoring"):
        retriever.invoke(haystack.query, scoring="bm25")
    with pytest.raises(TypeError, match="no_such_argument"):
        retriever.invoke(haystack.query, no_such_argument=1)


def test_retriever_needs_an_index_with_texts(bundled, haystack):
    from dice_fast import DiceIndex

    bare = DiceIndex.from_texts(bundled, haystack.texts[:2], store_text=False)
    with pytest.raises(ValueError, match="does not store its texts"):
        DiceRetriever(index=bare, k=1).invoke(haystack.query)
    with pytest.raises(ValueError, match="scoring"):
        DiceRetriever(index=bare, scoring="bm25").invoke(haystack.query)


def test_embeddings_pickle_and_load_their_model_again(bundled):
    import pickle

    from dice_fast import DiceEncoder

    emb = DiceEmbeddings(bundled)  # loaded from the bundled folder: loaded again from it
    copy = pickle.loads(pickle.dumps(emb))
    assert copy.encoder.config == bundled.config and copy.encoder is not bundled
    np.testing.assert_array_equal(np.asarray(copy.embed_documents(SHORT), np.float32), bundled.encode_documents(SHORT))
    bare = DiceEncoder(bundled.model, bundled.tokenizer, config=bundled.config)  # no folder
    with pytest.raises(TypeError, match=r"from_pretrained\(folder\) or DiceEncoder\(model, tokenizer, model_path"):
        pickle.dumps(DiceEmbeddings(bare))
    server = pickle.loads(pickle.dumps(DiceEmbeddings(base_url="http://127.0.0.1:9", client_options={"timeout": 5})))
    assert repr(server) == "DiceEmbeddings('http://127.0.0.1:9/v1/embeddings')" and server.encoder is None


def test_a_retriever_batch_builds_the_recorded_encoder_once(index, haystack, bundled, monkeypatch):
    """``batch`` / ``abatch`` search from several threads at once: a store loaded without an encoder builds
    the recorded one once (it was built once per thread: 4 model loads, or a crashed concurrent import)."""
    import threading
    import time

    from dice_fast import DiceIndex
    from dice_fast.index import common

    builds, lock = [], threading.Lock()

    def restore(model, options, where, device=None):
        with lock:
            builds.append(model)
        time.sleep(0.2)  # the threads' first searches overlap
        return bundled

    monkeypatch.setattr(common, "restore_encoder", restore)
    loaded = DiceIndex(index.dim, model="/models/recorded", encoder_options=dict(index.encoder_options))
    doc_of = np.repeat(np.arange(len(index)), np.diff(index.cu_doc_chunks))
    loaded.add_arrays(index.ids, index.documents, index.chunks, doc_of, index.chunk_start_char,
                      index.chunk_end_char, index.chunk_tokens, texts=list(index.texts))
    queries = [haystack.query, "a river", "the sky", "bread"]
    retriever = DiceRetriever(index=loaded, k=2)
    got = retriever.batch(queries)
    assert builds == ["/models/recorded"] and loaded.encoder is bundled
    assert [[d.id for d in docs] for docs in got] == \
        [[h.id for h in row] for row in index.search(queries, 2)]
    loaded.encoder = None  # the async twin: asyncio.gather of ainvoke
    async def gather():
        return await asyncio.gather(*(retriever.ainvoke(q) for q in queries))
    assert [[d.id for d in docs] for docs in asyncio.run(gather())] == [[d.id for d in docs] for docs in got]
    assert len(builds) == 2


def test_a_query_longer_than_the_window_is_refused_by_embed_query_and_cut_by_the_retriever(bundled, index):
    """As the module docstring says: ``embed_query`` refuses an over-window query (`QueryTooLong`, as a
    server does by default) where ``encode_queries``, and so a retriever's search, cuts it with a warning."""
    from dice_fast.integrations.langchain import QueryTooLong

    long_query = "river tree " * 400
    with pytest.raises(QueryTooLong, match="query 0 of this call has"):
        DiceEmbeddings(bundled).embed_query(long_query)
    with pytest.warns(UserWarning, match="longer than the model window"):
        docs = DiceRetriever(index=index, k=1).invoke(long_query)
    assert len(docs) == 1


def test_retriever_refuses_an_unknown_scoring_when_built():
    """As LlamaIndex's retriever does: the mistake surfaces where it is made, not at the first query."""
    from dice_fast.errors import OptionError

    with pytest.raises(OptionError, match=r"unknown scoring 'nope'; allowed: .*'maxsim'"):
        DiceRetriever(index=object(), scoring="nope")
    assert DiceRetriever(index=object(), scoring="hybrid").scoring == "hybrid"
    assert DiceRetriever(index=object()).scoring == "maxsim"


def test_a_cancelled_async_call_stops_at_its_next_batch(bundled):
    """A cancelled aembed_documents ran its whole encoding on in the event loop's default executor (six
    abandoned calls held every thread of it for seconds)."""
    import time

    from dice_fast import DiceEncoder

    enc = DiceEncoder(bundled.model, bundled.tokenizer, config=bundled.config.replace(max_batch_tokens=256))
    forwards = []
    hook = enc.model.register_forward_pre_hook(lambda module, args: forwards.append(time.monotonic()))
    texts = [f"text {i}: " + "the river ran past the old mill and on to the sea " * 40 for i in range(16)]
    emb = DiceEmbeddings(enc)

    async def cancelled():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(emb.aembed_documents(texts), 0.3)

    try:
        asyncio.run(cancelled())  # returns once the executor's thread is done (it waits for it)
        time.sleep(1.0)  # the batch running when the call was cancelled finishes
        ran = len(forwards)
        time.sleep(1.0)
        forwards.clear()
        enc.encode_documents(texts)  # the forwards of the whole call (the chunk cache is off)
        assert len(forwards) > 12 and 0 < ran < len(forwards) // 2, (ran, len(forwards))  # stopped long before
        short = ["a short text", "another one"]
        np.testing.assert_array_equal(np.asarray(asyncio.run(emb.aembed_documents(short)), np.float32),
                                      enc.encode_documents(short))
    finally:
        hook.remove()
