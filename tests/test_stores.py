"""The Qdrant (local mode, real qdrant-client) and LanceDB (real lancedb) stores against `DiceIndex` on
the same vectors: dice and maxsim hits (ids, order, scores, evidence spans, passages) equal its exact
search; hybrid scores exact with recall within the documented bound; re-adding replaces; the record
(dim, model, options) is kept and checked; query strings through the recorded encoder."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dice_fast import DiceEncoder, DiceIndex
from dice_fast.errors import InputError
from dice_fast.index import common, open_store
from dice_fast.index.qdrant_store import QdrantStore
from dice_fast.index.stores import split_url
from helpers import side_by_side
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
    assert store.contains(["doc-0", "doc-1", "nope"]) == index.contains(["doc-0", "doc-1", "nope"]) == [True, False, False]
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
    with pytest.raises(InputError, match="'other' does not exist$"):  # what `dice-fast search` opens with
        open_store(_url(kind, tmp_path, "other"), create=False)


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
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
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


class _SlowEncoder:
    """Stands for a recorded encoder rebuilt by `restore_encoder`: counts the builds, each slow enough
    that concurrent first searches overlap."""

    def __init__(self):
        self.builds, self._lock = 0, threading.Lock()

    def restore(self, model, options, where, device=None):
        with self._lock:
            self.builds += 1
        time.sleep(0.2)
        return self

    def encode_queries(self, queries):
        return np.tile(np.eye(DIM, dtype=np.float32)[:1], (len(queries), 1))


def _recorded(kind, tmp_path):
    """A store (or DiceIndex) of the _reference vectors recording a model but holding no encoder."""
    index, _ = _reference(n_docs=20)
    if kind == "dice_index":
        store = DiceIndex(DIM, model="/models/a", encoder_options={"chunk_size": 64})
    else:
        store = open_store(_url(kind, tmp_path), dim=DIM, model="/models/a", encoder_options={"chunk_size": 64})
    store.upsert_arrays(index.ids, *_arrays(index), texts=list(index.texts))
    assert store.encoder is None
    return store


@pytest.mark.parametrize("kind", ["dice_index", "qdrant-memory", "lancedb"])
def test_concurrent_first_searches_build_the_recorded_encoder_once(kind, tmp_path, monkeypatch):
    """A retriever's batch or asyncio.gather searches from several threads at once: the recorded encoder
    is built once (building it in each thread loaded the model 4 times, or crashed in a concurrent import)."""
    fake = _SlowEncoder()
    monkeypatch.setattr(common, "restore_encoder", fake.restore)
    store = _recorded(kind, tmp_path)
    with ThreadPoolExecutor(4) as pool:
        rows = list(pool.map(lambda q: store.search([q], 3)[0], ["a", "b", "c", "d"]))
    assert fake.builds == 1 and store.encoder is fake
    assert all([h.id for h in row] == [h.id for h in rows[0]] and len(row) == 3 for row in rows)


@pytest.mark.parametrize("kind", ["qdrant-memory", "lancedb"])
def test_writes_are_split_by_bytes_and_every_document_arrives(kind, tmp_path, monkeypatch):
    """A request holds at most about ``write_bytes`` (a Qdrant server refuses requests above 32 MB; 256
    long documents made one of ~266 MB): long documents go a few at a time, one above the budget alone."""
    index, queries = _reference(n_docs=60)
    store = open_store(_url(kind, tmp_path), dim=DIM)  # batch_size 256: only the byte budget splits
    store.write_bytes, store.float_bytes = 20_000, 24  # 24: Qdrant's (JSON); 5 chunks ~2.6 kB, doc-0 ~51 kB
    docs, chunks, doc_of, start, end, tokens = _arrays(index)
    long_chunks = np.repeat(chunks[:1], 120, axis=0)  # doc-0: one document of 120 chunks, above the budget
    keep = doc_of != 0
    args = (index.ids, docs, np.concatenate([long_chunks, chunks[keep]]),
            np.concatenate([np.zeros(120, np.int64), doc_of[keep]]),
            *(np.concatenate([np.arange(120), a[keep]]) for a in (start, end, tokens)))
    reference = DiceIndex(DIM)
    reference.add_arrays(*args, texts=list(index.texts))
    sizes, requests = [], []
    real_write = store._write
    monkeypatch.setattr(store, "_write", lambda b: (requests.append(list(b.ids)), real_write(b)))
    if kind == "qdrant-memory":  # the JSON the client sends a server: measured, not estimated
        from qdrant_client import models

        real_upsert = store.client.upsert
        monkeypatch.setattr(store.client, "upsert", lambda name, points, **kw: (
            sizes.append((len(points), len(models.PointsList(points=points).model_dump_json()))),
            real_upsert(name, points=points, **kw))[1])
    store.upsert_arrays(*args, texts=list(index.texts))
    assert len(requests) > 3 and requests[0] == ["doc-0"]  # the long one alone
    assert [i for r in requests for i in r] == index.ids and len(store) == len(index)
    assert all(size <= store.write_bytes for n, size in sizes if n > 1)
    assert len(sizes) == (len(requests) if kind == "qdrant-memory" else 0)
    assert _key(store.search(queries, 10)) == _key(reference.search(queries, 10))


def test_qdrant_deletes_in_requests_of_bounded_size(monkeypatch):
    store = open_store("qdrant+memory:///del", dim=DIM)
    index, _ = _reference(n_docs=5)
    store.upsert_arrays(index.ids, *_arrays(index), texts=list(index.texts))
    calls, asked = [], []
    real, retrieve = store.client.delete, store.client.retrieve
    monkeypatch.setattr(store.client, "delete", lambda name, points_selector, **kw: (
        calls.append(len(points_selector.points)), real(name, points_selector=points_selector, **kw))[1])
    monkeypatch.setattr(store.client, "retrieve", lambda name, ids, **kw: (asked.append(len(ids)),
                                                                            retrieve(name, ids=ids, **kw))[1])
    assert store.delete(["doc-1"] + [f"absent-{i}" for i in range(2500)] + ["doc-3"]) == 2
    assert asked == [1024, 1024, 454] and calls == [2]  # looked up in bounded requests, only the held deleted
    assert len(store) == 3 and store.contains(["doc-1", "doc-3"]) == [False, False]


@pytest.mark.parametrize("kind", ["qdrant-path", "lancedb", "dice_index"])
def test_a_store_made_for_vectors_records_its_first_encoder(kind, tmp_path, model_folder):
    """A store made with dim= records no model; its first write through an encoder records that
    encoder's model and options, so another encoder is refused as for a store opened with encoder=
    (it was accepted, mixing two vector spaces)."""
    a = DiceEncoder.from_pretrained(model_folder, device="cpu", chunk_size=4)
    b = DiceEncoder.from_pretrained(model_folder, device="cpu", chunk_size=8)
    store = DiceIndex(a.dim) if kind == "dice_index" else open_store(_url(kind, tmp_path), dim=a.dim)
    assert store.model is None
    store.attach_encoder(a, where=store.where)
    store.add(TEXTS[:2], ids=["x", "y"])
    refused = "chunk_size: the index has 4, the encoder 8"
    with pytest.raises(ValueError, match=refused):
        store.attach_encoder(b, where=store.where)
    if kind == "dice_index":
        store.save(tmp_path / "ix")
        with pytest.raises(ValueError, match=refused):
            DiceIndex.load(tmp_path / "ix", b)
        return
    _close(store)
    again = open_store(_url(kind, tmp_path))  # the record was written to the database
    assert again.model == str(model_folder.resolve()) and again.encoder_options["chunk_size"] == 4
    _close(again)
    with pytest.raises(ValueError, match=refused):
        open_store(_url(kind, tmp_path), encoder=b)
    import gc

    gc.collect()  # the refused store's local Qdrant client, kept by the traceback, lets go of its folder
    assert len(open_store(_url(kind, tmp_path), encoder=a)) == 2


def _close(store):
    """Let go of a local Qdrant folder now (one client a folder at a time)."""
    if hasattr(store, "client"):
        store.client.close()


def test_a_foreign_collection_or_table_is_refused(tmp_path):
    """A collection / table that dice_fast did not write (no record) is refused by name when opened,
    not when the first write fails; with or without dim=."""
    import lancedb
    from qdrant_client import QdrantClient, models

    client = QdrantClient(":memory:")
    client.create_collection("theirs", vectors_config=models.VectorParams(size=8, distance=models.Distance.COSINE))
    db = lancedb.connect(str(tmp_path / "l"))
    db.create_table("theirs", data=[{"vector": [0.1] * 8, "title": "theirs"}])
    foreign = "'theirs' exists but was not written by dice_fast"
    for options in ({}, {"dim": 16, "model": "/models/x"}):
        with pytest.raises(InputError, match=f"Qdrant collection {foreign}"):
            QdrantStore(client, "theirs", **options)
        with pytest.raises(InputError, match=f"LanceDB table {foreign}"):
            open_store(f"lancedb://{tmp_path}/l/theirs", **options)
    assert client.count("theirs").count == 0  # untouched


@pytest.mark.parametrize("kind", KINDS)
def test_a_zero_chunk_vector_scores_zero_and_hides_nothing(kind, tmp_path):
    """A zero chunk row (an encoder's pooled zero) scores 0, as in `DiceIndex`: LanceDB's cosine made it
    NaN and dropped its whole document from maxsim."""
    e = np.eye(4, dtype=np.float32)
    args = (["with_zero", "other"], e[:2], np.stack([e[0], np.zeros(4, np.float32), -e[0]]), [0, 0, 1], [0, 5, 0],
            [5, 9, 1], [1, 1, 1])
    index = DiceIndex(4, store_text=False)
    index.add_arrays(*args)
    store = open_store(_url(kind, tmp_path), dim=4, store_text=False)
    store.upsert_arrays(*args)
    for q in (e[:1], -e[:1]):  # -e0: with_zero's best chunk is its zero row (0 > -1)
        got, want = store.search(q, 2, "maxsim"), index.search(q, 2, "maxsim")
        assert _key(got) == _key(want) and len(got[0]) == 2
        np.testing.assert_allclose([h.score for h in got[0]], [h.score for h in want[0]], atol=1e-6)


@pytest.mark.parametrize("kind", ["qdrant-memory", "lancedb"])
def test_hybrid_returns_k_hits_when_candidates_are_fewer(kind, tmp_path):
    index, queries = _reference(n_docs=30)
    store = _filled(kind, tmp_path, index)
    got = store.search(queries, 10, "hybrid", alpha=0.5, candidates=3)  # at least k fetched per scoring
    assert [len(row) for row in got] == [10] * len(queries)
    truth = [{i: s for i, s, *_ in row} for row in brute_force(index, queries, len(index), "hybrid", alpha=0.5)]
    for row, scores in zip(got, truth):
        np.testing.assert_allclose([h.score for h in row], [scores[h.id] for h in row], atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_documents_without_chunks_are_hits_of_dice_only(kind, tmp_path):
    """A document without chunks (an empty text) has no maxsim score: no store returns it for maxsim or
    hybrid (`DiceIndex` returned it scoring -inf where the databases return nothing); dice ranks it."""
    rng = np.random.default_rng(1)
    docs = rng.standard_normal((3, DIM)).astype(np.float32)
    chunk = docs[1:2] / np.linalg.norm(docs[1])
    args = (["a", "b", "c"], docs, chunk, [1], [0], [3], [1])  # only b has a chunk
    index = DiceIndex(DIM)
    index.add_arrays(*args, texts=["", "bbb", ""])
    store = open_store(_url(kind, tmp_path), dim=DIM)
    store.upsert_arrays(*args, texts=["", "bbb", ""])
    queries = rng.standard_normal((4, DIM)).astype(np.float32)
    for scoring, alpha, n in (("maxsim", 0.0, 1), ("hybrid", 0.0, 1), ("hybrid", 0.5, 1), ("dice", 0.0, 3)):
        got, want = store.search(queries, 5, scoring, alpha=alpha), index.search(queries, 5, scoring, alpha=alpha)
        assert _key(got) == _key(want) and all(len(row) == n for row in got), (scoring, alpha)
        assert all(np.isfinite(h.score) for row in want for h in row)


@pytest.mark.parametrize("kind", ["qdrant-memory", "lancedb", "dice_index"])
def test_add_checks_ids_before_encoding(kind, tmp_path, model_folder, monkeypatch):
    """A wrong id count or a repeated id is refused by name before any text is encoded."""
    from dice_fast.errors import OptionError

    enc = DiceEncoder.from_pretrained(model_folder, device="cpu", chunk_size=4)
    encoded = []
    monkeypatch.setattr(enc, "encode_documents", lambda texts, **kw: encoded.append(texts))
    store = DiceIndex(enc.dim, enc) if kind == "dice_index" else open_store(_url(kind, tmp_path), encoder=enc)
    with pytest.raises(OptionError, match="got 2 ids for 3 documents"):
        store.add(TEXTS[:3], ["a", "b"])
    with pytest.raises(OptionError, match=r"duplicate id 'a': ids\[0\] and ids\[2\]"):
        store.add(TEXTS[:3], ["a", "b", "a"])
    assert encoded == [] and len(store) == 0


def test_a_qdrant_server_that_cannot_be_reached_is_named():
    """A server that is down (or refuses the key) was qdrant_client's traceback on `dice-fast search` / `push`."""
    with pytest.raises(InputError, match=r"Qdrant at http://127\.0\.0\.1:1: .*"):
        open_store("qdrant://127.0.0.1:1/docs", dim=4)


def test_a_store_closes_its_client_and_opens_again(tmp_path):
    """`dice-fast index push` / `search` left a local Qdrant's client open (its threads and file lock;
    "ImportError: sys.meta_path is None" at exit): a store is a context manager that closes it."""
    index, queries = _reference(n_docs=20)
    with _filled("qdrant-path", tmp_path, index) as store:
        want = _key(store.search(queries, 3, "maxsim"))
    with open_store(_url("qdrant-path", tmp_path)) as again:  # the local folder is free again
        assert len(again) == 20 and _key(again.search(queries, 3, "maxsim")) == want


@pytest.mark.parametrize("kind", ["qdrant-path", "qdrant-memory", "lancedb"])
def test_two_writers_and_a_searcher_share_a_store(kind, tmp_path):
    """Qdrant in process on disk ran two threads' writes as sqlite transactions on one connection at
    once and failed within a few writes (sqlite3.OperationalError, SystemError); its calls now take
    turns. Every store: no error, and each stored document is whole (its vector is its own)."""
    index, queries = _reference(n_docs=60)
    store = open_store(_url(kind, tmp_path), dim=DIM, batch_size=7)

    def rows(keys):
        keep = np.isin(np.arange(len(index)), keys)
        doc_of = np.repeat(np.arange(len(keys)), np.diff(index.cu_doc_chunks)[keep])
        chunks = np.repeat(keep, np.diff(index.cu_doc_chunks))
        return ([index.ids[k] for k in keys], index.documents[keep], index.chunks[chunks], doc_of,
                index.chunk_start_char[chunks], index.chunk_end_char[chunks], index.chunk_tokens[chunks])

    def write(rng):
        keys = sorted(rng.sample(range(len(index)), 4))
        ids, *arrays = rows(keys)
        if rng.random() < 0.7:
            store.upsert_arrays(ids, *arrays, texts=[index.texts[k] for k in keys])
        else:
            store.delete(ids)

    def search(rng):
        for hit in store.search(queries[:2], k=5, scoring="dice")[0]:
            d = index.ids.index(hit.id)
            assert abs(hit.score - float(index.documents[d] @ queries[0])) < 1e-4, hit

    try:
        counts = side_by_side([write, write, search], 2.0)
    finally:
        store.close()
    assert min(counts.values()) > 0, counts


@pytest.mark.parametrize("kind", ["dice_index", "qdrant-memory", "lancedb"])
def test_every_store_answers_edge_inputs_alike(kind, tmp_path):
    """What a differential run of the three stores found them to answer differently: a NaN query (-inf
    hits, an error, nothing), an id that is not valid Unicode in contains / delete (False, or a
    UnicodeEncodeError), delete's return (a count, or None), a huge k (LanceDB: OverflowError), ids=None
    and one string as ids (read a character at a time)."""
    from dice_fast.errors import ArgumentTypeError, OptionError

    index, queries = _reference(n_docs=12)
    if kind == "dice_index":
        store = DiceIndex(DIM)
        store.add_arrays(index.ids, *_arrays(index), texts=list(index.texts))
    else:
        store = _filled(kind, tmp_path, index)
    bad = queries[:2].copy()
    bad[1, 3] = np.nan
    with pytest.raises(InputError, match="query vector 1 holds NaN or an infinity"):
        store.search(bad, 3)
    assert store.contains([index.ids[0], "\ud800", "absent"]) == [True, False, False]
    assert store.delete([index.ids[0], "\ud800", index.ids[0], "absent"]) == 1
    assert len(store) == 11 and store.contains([index.ids[0]]) == [False]
    assert [h.id for h in store.search(queries[:1], 2**40)[0]] == [h.id for h in store.search(queries[:1], 11)[0]]
    with pytest.raises(ArgumentTypeError, match="ids must be a list of ids, not a single str"):
        store.delete(index.ids[1])
    with pytest.raises(ArgumentTypeError, match="not a single str"):
        store.contains("ab")
    if kind == "dice_index":
        with pytest.raises(ArgumentTypeError, match="not a single str"):
            store.add(["a text", "another"], "ab")  # ids "a" and "b" before
    if kind != "dice_index":  # DiceIndex.add_arrays numbers documents given no ids
        with pytest.raises(OptionError, match="ids are required"):
            store.upsert_arrays(None, *_arrays(index))
    assert len(store) == 11


def test_lancedb_finds_ids_through_an_index_kept_up_to_date(tmp_path, monkeypatch):
    """Ids were found by scanning the table (no index on ``id``, one more fragment a write): every write,
    `contains`, `fetch` and `delete` cost time in proportion to the table, a push of N documents O(N^2)
    (RESULTS §38). The id index is made with the table, or at the first write to a table made before,
    and the new rows are indexed every OPTIMIZE_EVERY writes; answers stay those of the exact index."""
    from dice_fast.index import lance_store

    monkeypatch.setattr(lance_store, "OPTIMIZE_EVERY", 3)
    index, queries = _reference(n_docs=120)
    monkeypatch.setattr(lance_store.LanceStore, "_index_ids", lambda self: None)  # a table made before
    store = open_store(_url("lancedb", tmp_path), dim=DIM, batch_size=20)
    assert store.table.list_indices() == []
    monkeypatch.undo()
    monkeypatch.setattr(lance_store, "OPTIMIZE_EVERY", 3)
    store = open_store(_url("lancedb", tmp_path), dim=DIM, batch_size=20)
    store.upsert_arrays(index.ids, *_arrays(index), texts=list(index.texts))  # 6 writes of 20
    [ix] = [i for i in store.table.list_indices() if list(i.columns) == ["id"]]
    assert store.table.index_stats(ix.name).num_unindexed_rows == 0  # indexed at write 1, optimized at 3 and 6
    assert store.delete(index.ids[:5]) == 5 and store.contains(index.ids[:6]) == [False] * 5 + [True]
    assert set(store.fetch(index.ids[:8])) == set(index.ids[5:8])
    index.delete(index.ids[:5])
    assert _key(store.search(queries, 10)) == _key(index.search(queries, 10))
    fresh = open_store(_url("lancedb", tmp_path, "new"), dim=DIM)
    assert [list(i.columns) for i in fresh.table.list_indices()] == [["id"]]


def test_lancedb_id_index_refused_once_is_made_at_a_later_write(tmp_path, monkeypatch):
    """A table another writer is changing may refuse the index for a moment: the store tries again."""
    from dice_fast.index import lance_store

    monkeypatch.setattr(lance_store, "OPTIMIZE_EVERY", 3)
    index, _ = _reference(n_docs=60)
    with monkeypatch.context() as m:
        m.setattr(lance_store.LanceStore, "_index_ids", lambda self: None)  # a table made before
        open_store(_url("lancedb", tmp_path), dim=DIM)
    store = open_store(_url("lancedb", tmp_path), dim=DIM, batch_size=20)
    real, calls = store.table.create_index, []

    def busy_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("lance error: Retryable commit conflict")
        return real(*args, **kwargs)

    monkeypatch.setattr(store.table, "create_index", busy_once)
    store.upsert_arrays(index.ids, *_arrays(index), texts=list(index.texts))  # writes 1 (refused), 2, 3
    assert len(calls) == 2 and [list(i.columns) for i in store.table.list_indices()] == [["id"]]


def test_lancedb_indexes_are_made_by_the_api_lancedb_keeps(tmp_path):
    """``create_scalar_index`` and ``create_index(metric=..., vector_column_name=...)`` are deprecated in
    lancedb 0.40 (DeprecationWarning at every table the store made, and at `build_index`); lancedb before
    0.34, which has no ``config=``, still gets the old calls."""
    import warnings

    from dice_fast.index import lance_store

    index, queries = _reference(n_docs=300)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        store = _filled("lancedb", tmp_path, index)
        store.build_index("doc", num_partitions=2, num_sub_vectors=4)
    assert sorted((i.index_type, tuple(i.columns)) for i in store.table.list_indices()) == [
        ("BTree", ("id",)), ("IvfPq", ("doc",))]
    assert [h[0].id for h in store.search(queries[:3], 1, "maxsim")] == [h[0].id for h in index.search(queries[:3], 1, "maxsim")]

    class Old:  # lancedb 0.25-0.33: a sync table's create_index takes no config
        def create_index(self, metric="l2", **legacy_only):
            raise TypeError("create_index() got an unexpected keyword argument 'config'")

    made = []
    lance_store._create_index(Old(), "id", object(), replace=False, legacy=lambda: made.append("legacy"))
    assert made == ["legacy"]
