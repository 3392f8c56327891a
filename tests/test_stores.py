"""The Qdrant (local mode, real qdrant-client) and LanceDB (real lancedb) stores against `DiceIndex` on
the same vectors: dice and maxsim hits (ids, order, scores, evidence spans, passages) equal its exact
search; hybrid scores exact with recall within the documented bound; re-adding replaces; the record
(dim, model, options) is kept and checked; query strings through the recorded encoder."""

from __future__ import annotations

import numpy as np
import pytest

from dice_fast import DiceEncoder, DiceIndex
from dice_fast.errors import InputError
from dice_fast.index import open_store
from dice_fast.index.stores import split_url
from test_index import _random_index, brute_force
from test_index_folder import TEXTS, model_folder  # noqa: F401 (a fixture)

pytest.importorskip("qdrant_client")
pytest.importorskip("lancedb")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
DIM = 16
HYBRID_RECALL = 0.95  # documented in docs/retrieval.md: the union of the dice and maxsim top max(4k, 40)


def _url(kind, tmp_path, name="docs"):
    return {"qdrant-memory": f"qdrant+memory:///{name}", "qdrant-path": f"qdrant+path://{tmp_path}/q/{name}",
            "lancedb": f"lancedb://{tmp_path}/l/{name}"}[kind]


def _texts(index):
    return [f"document {i} " + "word " * 40 for i in range(len(index))]


def _arrays(index):
    doc_of = np.repeat(np.arange(len(index)), np.diff(index.cu_doc_chunks))
    return (index.documents, index.chunks, doc_of, index.chunk_start_char, index.chunk_end_char, index.chunk_tokens)


def _reference(n_docs=300, seed=0):
    index, queries = _random_index(seed=seed, n_docs=n_docs)
    with_text = DiceIndex(DIM)
    with_text.add_arrays(index.ids, *_arrays(index), texts=_texts(index))
    rng = np.random.default_rng(seed + 10)
    queries = rng.standard_normal((20, DIM)).astype(np.float32)
    return with_text, queries / np.linalg.norm(queries, axis=1, keepdims=True)


def _filled(kind, tmp_path, index, batch_size=37):
    store = open_store(_url(kind, tmp_path), dim=DIM, batch_size=batch_size)
    store.upsert_arrays(index.ids, *_arrays(index), texts=list(index.texts))
    return store


def _key(hits):
    return [[(h.id, h.chunk, h.start_char, h.end_char, h.text) for h in row] for row in hits]


KINDS = ["qdrant-memory", "qdrant-path", "lancedb"]


@pytest.mark.parametrize("kind", KINDS)
def test_dice_and_maxsim_hits_equal_the_exact_index(kind, tmp_path):
    index, queries = _reference()
    store = _filled(kind, tmp_path, index)
    assert len(store) == len(index)
    for scoring in ("dice", "maxsim"):
        for k in (1, 10):
            got, want = store.search(queries, k, scoring), index.search(queries, k, scoring)
            assert _key(got) == _key(want), scoring
            np.testing.assert_allclose([h.score for r in got for h in r], [h.score for r in want for h in r], atol=1e-5)
            np.testing.assert_allclose([h.chunk_score for r in got for h in r],
                                       [h.chunk_score for r in want for h in r], atol=1e-5)
    assert store.search(queries, 5) == store.search(queries, 5, "maxsim")  # the default scoring


@pytest.mark.parametrize("kind", ["qdrant-memory", "lancedb"])
def test_hybrid_scores_are_exact_and_recall_is_within_the_bound(kind, tmp_path):
    index, queries = _reference()
    store = _filled(kind, tmp_path, index)
    exact = brute_force(index, queries, len(index), "hybrid", alpha=0.5)
    truth = [{i: s for i, s, *_ in row} for row in exact]
    got = store.search(queries, 10, "hybrid", alpha=0.5)
    for row, scores in zip(got, truth):
        np.testing.assert_allclose([h.score for h in row], [scores[h.id] for h in row], atol=1e-5)
        assert [h.score for h in row] == sorted((h.score for h in row), reverse=True)
    want = index.search(queries, 10, "hybrid", alpha=0.5)
    recall = np.mean([len({h.id for h in a} & {h.id for h in b}) / 10 for a, b in zip(got, want)])
    assert recall >= HYBRID_RECALL
    assert _key(store.search(queries, 10, "hybrid", alpha=0.5, candidates=len(index))) == _key(want)
    assert _key(store.search(queries, 5, "hybrid", alpha=0.0)) == _key(index.search(queries, 5, "hybrid", alpha=0.0))


@pytest.mark.parametrize("kind", KINDS)
def test_re_adding_replaces_and_delete_removes(kind, tmp_path):
    index, queries = _reference(n_docs=120)
    store = _filled(kind, tmp_path, index)
    other, _ = _random_index(seed=7, n_docs=120)
    change = list(range(0, 120, 3))  # a third of the documents get new vectors, spans and texts
    sub = DiceIndex(DIM)
    keep = np.zeros(len(other), bool)
    keep[change] = True
    docs, chunks, doc_of, start, end, tokens = _arrays(other)
    mask = keep[doc_of]
    remap = np.cumsum(keep) - 1
    new_texts = [f"changed {i} " * 8 for i in change]
    args = ([index.ids[i] for i in change], docs[keep], chunks[mask], remap[doc_of[mask]], start[mask], end[mask],
            tokens[mask])
    sub.add_arrays(*args, texts=new_texts)
    store.upsert_arrays(*args, texts=new_texts)
    index.upsert_arrays(*args, texts=new_texts)
    assert len(store) == len(index) == 120
    for scoring in ("dice", "maxsim"):
        assert _key(store.search(queries, 10, scoring)) == _key(index.search(queries, 10, scoring))
    gone = [f"doc-{i}" for i in range(1, 11)]
    store.delete(gone + ["not-there"])
    assert index.delete(gone + ["not-there"]) == 10
    assert len(store) == len(index) == 110
    assert store.contains(["doc-0", "doc-1", "nope"]) == [True, False, False]
    assert _key(store.search(queries, 10, "maxsim")) == _key(index.search(queries, 10, "maxsim"))


@pytest.mark.parametrize("kind", ["qdrant-path", "lancedb"])
def test_the_record_is_kept_and_checked(kind, tmp_path):
    index, queries = _reference(n_docs=50)
    store = open_store(_url(kind, tmp_path), dim=DIM, model="/models/a", encoder_options={"chunk_size": 64},
                       store_text=False)
    store.upsert_arrays(index.ids, *_arrays(index))
    want = _key(store.search(queries, 5))
    del store
    again = open_store(_url(kind, tmp_path))  # no arguments: the recorded width, model, options, texts
    assert (again.dim, again.model, again.encoder_options, again.store_text) == (DIM, "/models/a", {"chunk_size": 64}, False)
    assert _key(again.search(queries, 5)) == want and want[0][0][4] is None
    del again
    with pytest.raises(ValueError, match="holds vectors with dim 16, not 8"):
        open_store(_url(kind, tmp_path), dim=8)
    with pytest.raises(ValueError, match="holds vectors with model '/models/a'"):
        open_store(_url(kind, tmp_path), model="/models/b", encoder_options={"chunk_size": 64})
    with pytest.raises(ValueError, match="does not exist: give dim= or encoder="):
        open_store(_url(kind, tmp_path, "other"))


def test_query_strings_through_the_recorded_encoder(tmp_path, model_folder):
    enc = DiceEncoder.from_pretrained(model_folder, device="cpu", chunk_size=4, query_prefix="query: ")
    index = DiceIndex.from_texts(enc, TEXTS, ids=list("abcde"))
    url = _url("lancedb", tmp_path)
    store = open_store(url, encoder=enc)
    store.add(TEXTS, ids=list("abcde"))
    queries = ["tree under blue sky", "river water"]
    assert _key(store.search(queries, 3)) == _key(index.search(queries, 3))
    del store
    back = open_store(url)  # rebuilds the recorded encoder (query_prefix included) when a string comes
    assert back.encoder is None
    assert _key(back.search(queries, 3)) == _key(index.search(queries, 3))
    with pytest.raises(ValueError, match="query_prefix: the index has 'query: ', the encoder ''"):
        open_store(url, encoder=DiceEncoder.from_pretrained(model_folder, device="cpu", chunk_size=4))


def test_store_urls_and_bad_batches_are_named():
    assert split_url("qdrant://localhost:6333/docs") == ("qdrant://", "localhost:6333", "docs")
    assert split_url("qdrant+path:///abs/dir/docs") == ("qdrant+path://", "/abs/dir", "docs")
    assert split_url("lancedb://rel/dir/t") == ("lancedb://", "rel/dir", "t")
    for bad in ("qdrant://", "milvus://h/c", "lancedb://table-without-dir", "qdrant+path://dir/"):
        with pytest.raises(ValueError, match="is not one of qdrant://HOST:PORT/COLLECTION"):
            split_url(bad)
    store = open_store("qdrant+memory:///x", dim=DIM, batch_size=2)
    index, _ = _random_index(n_docs=4)
    docs, chunks, doc_of, start, end, tokens = _arrays(index)
    with pytest.raises(ValueError, match="duplicate id 'doc-1'"):
        store.upsert_arrays(["doc-0", "doc-1", "doc-1", "doc-3"], *_arrays(index), texts=["a"] * 4)
    with pytest.raises(ValueError, match="keeps texts: pass one text per document"):
        store.upsert_arrays(index.ids, *_arrays(index))
    with pytest.raises(ValueError, match=r"expected \(n, 16\) vectors"):
        store.upsert_arrays(index.ids, docs[:, :4], chunks, doc_of, start, end, tokens, texts=["a"] * 4)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        open_store("qdrant+memory:///y", dim=DIM, batch_size=0)
    assert len(store) == 0


@pytest.mark.parametrize("kind", ["qdrant-memory", "lancedb"])
def test_repr_hybrid_at_alpha_one_and_non_finite_vectors(kind, tmp_path):
    store = open_store(_url(kind, tmp_path), dim=4, store_text=False, batch_size=2)
    e = np.eye(4, dtype=np.float32)
    docs = np.stack([0.9 * e[0] + e[1], 0.7 * e[0] + e[2], 0.5 * e[0] + e[3]])  # d1 has no chunks
    bad = docs.copy()
    bad[2, 1] = np.nan
    with pytest.raises(InputError, match=r"id 'd2' \(ids\[2\]\): its document vector holds NaN"):
        store.upsert_arrays(["d0", "d1", "d2"], bad, docs[[0, 2]], [0, 2], [0, 0], [1, 1], [1, 1])
    assert len(store) == 0  # refused before the first batch was written
    store.upsert_arrays(["d0", "d1", "d2"], docs, docs[[0, 2]], [0, 2], [0, 0], [1, 1], [1, 1])
    hits = store.search(e[:1], 3, "hybrid", alpha=1.0)[0]
    assert [(h.id, round(h.score, 5)) for h in hits] == [("d0", 0.9), ("d1", 0.7), ("d2", 0.5)]
    assert repr(store).endswith("3 documents, dim=4)")
