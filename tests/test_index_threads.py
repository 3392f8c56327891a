"""DiceIndex under threads: searches (exact and approximate), saves and `contains` beside adds,
upserts and deletes. Every document's vectors and spans are a function of its id, so whatever the
index holds at the moment of a search, each hit must carry its own id's score, chunk and span: a
search that read one write half done pairs an id with another document's vectors and fails here."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dice_fast import DiceIndex
from dice_fast.index.rwlock import ReadWriteLock
from dice_fast.scoring import DEFAULT_ALPHA
from helpers import side_by_side

DIM, KEYS = 16, 300
STRESS_S = 2.5  # wall-clock seconds of the mixed workload


def _unit(rng, n):
    v = rng.standard_normal((n, DIM))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _document(key: int):
    """(document vector (DIM,), chunk vectors (n, DIM), starts (n,), ends (n,)) of document ``key``."""
    rng = np.random.default_rng(key)
    n = key % 4  # key 0, 4, 8, ...: no chunks
    start = 10 * np.arange(n)
    return _unit(rng, 1)[0], _unit(rng, n), start, start + 5 + key % 7


def _batch(keys):
    parts = [_document(k) for k in keys]
    counts = [len(p[1]) for p in parts]
    return ([f"k{k}" for k in keys], np.stack([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.repeat(np.arange(len(keys)), counts), np.concatenate([p[2] for p in parts]),
            np.concatenate([p[3] for p in parts]), np.ones(sum(counts), np.int64))


def _check_hit(q, hit, scoring):
    key = int(hit.id[1:])
    doc, chunks, start, end = _document(key)
    per = chunks.astype(np.float64) @ q
    best = per.max() if len(per) else -np.inf
    dice = float(doc.astype(np.float64) @ q)
    want = {"dice": dice, "maxsim": best, "hybrid": DEFAULT_ALPHA * dice + (1 - DEFAULT_ALPHA) * best}[scoring]
    assert abs(hit.score - want) < 1e-5, (hit, want)
    if len(per):
        j = int(per.argmax())
        assert (hit.chunk, hit.start_char, hit.end_char) == (j, start[j], end[j]), hit
        assert abs(hit.chunk_score - best) < 1e-5
    else:
        assert hit.chunk == -1


def test_searches_beside_writes_see_each_document_whole(tmp_path):
    pytest.importorskip("faiss")
    index = DiceIndex(DIM, store_text=False)
    index.add_arrays(*_batch(range(0, KEYS, 2)))
    index.build_graph("maxsim")

    def search(rng):
        q = _unit(np.random.default_rng(rng.randrange(1 << 30)), 3)
        scoring = rng.choice(["dice", "maxsim", "hybrid"])
        for qv, hits in zip(q, index.search(q, k=7, scoring=scoring, approximate=rng.random() < 0.3,
                                            candidates=8)):
            assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
            assert len({h.id for h in hits}) == len(hits)
            for hit in hits:
                _check_hit(qv.astype(np.float64), hit, scoring)

    def write(rng):
        keys = rng.sample(range(KEYS), rng.randrange(1, 12))
        op = rng.random()
        if op < 0.4:
            index.upsert_arrays(*_batch(keys))
        elif op < 0.7:
            index.delete([f"k{k}" for k in keys])
        else:
            present = index.contains([f"k{k}" for k in keys])
            new = [k for k, p in zip(keys, present) if not p]
            try:
                index.add_arrays(*_batch(new)) if new else None
            except ValueError as exc:  # another writer added one of them in between: refused by name
                assert "already in the index" in str(exc)

    def save(rng):
        folder = tmp_path / f"save{rng.randrange(3)}"
        index.save(folder)
        again = DiceIndex.load(folder)
        for i, name in enumerate(again.ids):  # a save is one moment of the index: every document whole
            doc, chunks, start, _ = _document(int(name[1:]))
            c0, c1 = again.cu_doc_chunks[i], again.cu_doc_chunks[i + 1]
            np.testing.assert_array_equal(again.documents[i], doc)
            np.testing.assert_array_equal(again.chunk_start_char[c0:c1], start)
        time.sleep(0.05)

    counts = side_by_side([search, search, search, write, write, save], STRESS_S)
    assert len(counts) == 3 and min(counts.values()) > 0, counts
    assert len(index) == len(set(index.ids)) == len(index.documents)
    assert index.cu_doc_chunks[-1] == len(index.chunks)


def test_a_waiting_writer_holds_back_new_readers_and_gets_its_turn():
    lock, order = ReadWriteLock(), []
    first_in, writer_waiting = threading.Event(), threading.Event()

    def first_reader():
        with lock.reading():
            first_in.set()
            writer_waiting.wait(5)
            time.sleep(0.1)  # the late reader arrives while the writer waits
            order.append("reader 1 out")

    def writer():
        first_in.wait(5)
        writer_waiting.set()
        with lock.writing():
            order.append("writer")

    def late_reader():
        writer_waiting.wait(5)
        time.sleep(0.05)
        with lock.reading():
            order.append("reader 2")

    threads = [threading.Thread(target=f) for f in (first_reader, writer, late_reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["reader 1 out", "writer", "reader 2"]


def test_a_pickled_index_searches_and_grows_as_the_original(tmp_path):
    """The lock made a DiceIndex unpicklable (Ray and process pools pickle what they send): it is
    pickled as one moment of the index, without its lock, encoder or built faiss graphs."""
    import pickle

    pytest.importorskip("faiss")
    index = DiceIndex(DIM)
    ids, *arrays = _batch(range(40))
    index.add_arrays(ids, *arrays, texts=[f"text of {i}" for i in ids])
    index.build_graph("maxsim")
    again = pickle.loads(pickle.dumps(index))
    q = _unit(np.random.default_rng(5), 4)
    for approximate in (False, True):
        assert again.search(q, k=5, approximate=approximate) == index.search(q, k=5, approximate=approximate)
    for target in (index, again):  # each grows on its own, from the buffers' filled parts
        target.add_arrays(*_batch([100, 101]), texts=["a", "b"])
        target.delete(["k3"])
    assert again.search(q, k=50) == index.search(q, k=50) and again.texts[-1] == "b"
    again.save(tmp_path / "ix")
    assert DiceIndex.load(tmp_path / "ix").ids == index.ids
