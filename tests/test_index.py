"""DiceIndex: hits equal a brute-force float64 scoring of the same vectors (every scoring, blocked
search, float16 chunk storage), save/load round trip, refusals, and an end-to-end build from texts."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from dice_fast import DiceEncoder, DiceIndex
from dice_fast.errors import InputError
from dice_fast.index import top
from dice_fast.scoring import DEFAULT_ALPHA
from tiny_models import tiny

DIM = 16
FLOAT16_TOLERANCE = 2e-3  # |score| of unit vectors in float16 storage vs float32, dim 16


def _unit(rng, n):
    v = rng.standard_normal((n, DIM))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _random_index(seed=0, n_docs=40, chunk_dtype="float32"):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 6, n_docs)
    counts[3] = 0  # a document without chunks (an empty text)
    n_chunks = int(counts.sum())
    doc_of = np.repeat(np.arange(n_docs), counts)
    start = rng.integers(0, 100, n_chunks)
    index = DiceIndex(DIM, store_text=False, chunk_dtype=chunk_dtype)
    index.add_arrays([f"doc-{i}" for i in range(n_docs)], _unit(rng, n_docs), _unit(rng, n_chunks), doc_of,
                     start, start + rng.integers(1, 50, n_chunks), rng.integers(1, 9, n_chunks))
    return index, _unit(rng, 5)


def brute_force(index: DiceIndex, queries, k, scoring, alpha=DEFAULT_ALPHA):
    """Per query: [(id, score, chunk, chunk_score)] of the top k, float64, one document at a time."""
    docs, chunks, cu = index.documents.astype(np.float64), index.chunks.astype(np.float64), index.cu_doc_chunks
    out = []
    for q in queries.astype(np.float64):
        rows = []
        for d in range(len(index)):
            per = chunks[cu[d] : cu[d + 1]] @ q
            best = per.max() if len(per) else -np.inf
            s = {"dice": docs[d] @ q, "maxsim": best, "hybrid": alpha * (docs[d] @ q) + (1 - alpha) * best}[scoring]
            if scoring == "dice" or s != -np.inf:  # no chunks: no maxsim score, never a maxsim / hybrid hit
                rows.append((-s, d, int(per.argmax()) if len(per) else -1, best))
        rows.sort()
        out.append([(index.ids[d], -s, c, b) for s, d, c, b in rows[:k]])
    return out


def assert_hits_equal(got, want, atol=1e-5):
    assert [[h.id for h in row] for row in got] == [[w[0] for w in row] for row in want]
    assert [[h.chunk for h in row] for row in got] == [[w[2] for w in row] for row in want]
    for hits, wants in zip(got, want):
        np.testing.assert_allclose([h.score for h in hits], [w[1] for w in wants], atol=atol)
        np.testing.assert_allclose([h.chunk_score for h in hits], [w[3] for w in wants], atol=atol)


@pytest.mark.parametrize("scoring", ["dice", "maxsim", "hybrid"])
@pytest.mark.parametrize("block", [1 << 22, 7])
def test_hits_equal_brute_force(scoring, block, monkeypatch):
    monkeypatch.setattr(top, "BLOCK_SCORES", block)  # 7: blocks of one or two documents
    index, queries = _random_index()
    for k in (1, 5, 100):
        got = index.search(queries, k=k, scoring=scoring, alpha=0.5)  # a real blend (the default is 0)
        assert_hits_equal(got, brute_force(index, queries, k, scoring, alpha=0.5))
        for row in got:  # doc-3 has no chunks: a dice hit only
            assert len(row) == min(k, len(index) - (scoring != "dice"))
            assert all(np.isfinite(h.score) for h in row)
            for h in row:
                d = index.ids.index(h.id)
                if h.chunk >= 0:
                    c = index.cu_doc_chunks[d] + h.chunk
                    assert (h.start_char, h.end_char) == (index.chunk_start_char[c], index.chunk_end_char[c])


def test_chunks_are_stored_unit_length_so_maxsim_is_a_cosine():
    """Raw chunk vectors (an encoder whose normalize_chunks is False) are stored L2-normalised: the
    hits equal those over the unit vectors, and a zero vector stays zero (scores 0, not NaN)."""
    index, queries = _random_index(seed=1)
    rng = np.random.default_rng(2)
    raw = index.chunks * rng.uniform(0.1, 20.0, (index.n_chunks, 1)).astype(np.float32)
    raw[0] = 0.0
    doc_of = np.repeat(np.arange(len(index)), np.diff(index.cu_doc_chunks))
    scaled = DiceIndex(DIM, store_text=False)
    scaled.add_arrays(index.ids, index.documents, raw, doc_of, index.chunk_start_char, index.chunk_end_char,
                      index.chunk_tokens)
    norms = np.linalg.norm(scaled.chunks, axis=1)
    np.testing.assert_allclose(norms[1:], 1.0, atol=1e-6)
    assert norms[0] == 0.0
    want = index.chunks.copy()
    want[0] = 0.0
    np.testing.assert_allclose(scaled.chunks, want, atol=1e-6)
    assert_hits_equal(scaled.search(queries, k=10, scoring="maxsim"), brute_force(scaled, queries, 10, "maxsim"))


@pytest.mark.parametrize("scoring", ["dice", "maxsim", "hybrid"])
def test_float16_chunks_are_exact_over_their_rounded_vectors_and_close_to_float32(scoring):
    full, queries = _random_index()
    half, _ = _random_index(chunk_dtype="float16")
    assert half.chunks.dtype == np.float16 and half.chunks.nbytes * 2 == full.chunks.nbytes
    got = half.search(queries, k=10, scoring=scoring)
    assert_hits_equal(got, brute_force(half, queries, 10, scoring))
    for row, frow in zip(got, full.search(queries, k=10, scoring=scoring)):
        f = {h.id: h.score for h in frow}
        assert all(abs(h.score - f[h.id]) < FLOAT16_TOLERANCE for h in row if h.id in f)


def test_approximate_search_scores_its_candidates_exactly():
    pytest.importorskip("faiss")
    index, queries = _random_index()
    for scoring in ("dice", "maxsim"):
        exact = index.search(queries, k=5, scoring=scoring)
        approx = index.search(queries, k=5, scoring=scoring, approximate=True, candidates=len(index) * 5)
        assert_hits_equal(approx, [[(h.id, h.score, h.chunk, h.chunk_score) for h in row] for row in exact])


def test_save_load_round_trip_and_refusals(tmp_path):
    index, queries = _random_index(chunk_dtype="float16")
    index.save(tmp_path / "ix")
    back = DiceIndex.load(tmp_path / "ix")
    for scoring in ("dice", "maxsim", "hybrid"):
        assert back.search(queries, 7, scoring) == index.search(queries, 7, scoring)
    assert back.chunk_dtype == "float16" and back.ids == index.ids
    with pytest.raises(ValueError, match="no index.json"):
        DiceIndex.load(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no dice_fast index"):
        index.save(tmp_path / "other")
    meta = json.loads((tmp_path / "ix" / "index.json").read_text())
    np.save(tmp_path / "ix" / meta["files"]["chunks"]["file"], np.zeros((3, DIM), np.float16))
    with pytest.raises(ValueError, match=r"chunks\.[0-9a-f]{12}\.npy: shape \(3, 16\)"):
        DiceIndex.load(tmp_path / "ix")
    (tmp_path / "ix" / "index.json").write_text(json.dumps({**meta, "format": "something/9"}))
    with pytest.raises(ValueError, match="format 'something/9'"):
        DiceIndex.load(tmp_path / "ix")


def test_bad_queries_and_ids_are_named():
    index, queries = _random_index()
    assert index.search(queries[:0], k=3) == []
    assert DiceIndex(DIM).search(queries, k=3) == [[]] * len(queries)
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="k must be an integer >= 1"):
            index.search(queries, k=k)
        with pytest.raises(ValueError, match="candidates must be an integer >= 1"):  # 2.7 was taken as 2
            index.search(queries, approximate=True, candidates=k + 1.7 if k != 0 else 0)
    with pytest.raises(ValueError, match="unknown scoring 'bm25'"):
        index.search(queries, scoring="bm25")
    with pytest.raises(ValueError, match="no encoder"):
        index.search(["a query"])
    with pytest.raises(ValueError, match=r"query vectors must be \(n, 16\)"):
        index.search(queries[:, :4])
    with pytest.raises(ValueError, match=r"duplicate id 'doc-2': ids\[0\] is already in the index"):
        index.add_arrays(["doc-2"], queries[:1], queries[:1], [0], [0], [1], [1])
    with pytest.raises(ValueError, match=r"duplicate id 'x': ids\[0\] and ids\[1\]"):
        index.add_arrays(["x", "x"], queries[:2], queries[:2], [0, 1], [0, 0], [1, 1], [1, 1])


def test_empty_and_blank_documents_are_never_maxsim_hits():
    """An empty or blank text is one chunk of its special tokens alone, whose vector sits near every
    short query: with the bundled model "", "   " and a zero-width joiner took the first three places
    of every maxsim search for "the" (0.52 against 0.16). Such a chunk is evidence of nothing: not
    stored, so the document has no maxsim score (as documented); dice still ranks its vector."""
    model, tok = tiny("bert")[:2]
    enc = DiceEncoder(model, tok, chunk_size=4, pooling="mean", pooling_impl="torch")
    texts = ["", " \n\t", "the cat sat on a mat and the dog ran"]
    index = DiceIndex.from_texts(enc, texts, ids=["empty", "blank", "cat"])
    assert index.n_chunks == len(enc.encode_documents(texts[2:], return_chunks=True).chunks)
    assert list(np.diff(index.cu_doc_chunks)[:2]) == [0, 0]
    for scoring in ("maxsim", "hybrid"):
        assert [[h.id for h in row] for row in index.search(["the", "a"], k=3, scoring=scoring)] == [["cat"]] * 2
    assert sorted(h.id for h in index.search(["the"], k=3, scoring="dice")[0]) == ["blank", "cat", "empty"]


def test_from_texts_finds_the_passage_with_its_text():
    model, tok = tiny("bert")[:2]
    enc = DiceEncoder(model, tok, chunk_size=4, pooling="mean", pooling_impl="torch")
    texts = ["the cat sat on a mat and the dog ran", "big red house with tree under blue sky", ""]
    index = DiceIndex.from_texts(enc, texts, ids=["a", "b", "c"])
    index.add(["green old river water fire road city"], ids=["d"])
    with pytest.raises(ValueError, match="duplicate id 'a'"):
        index.add(["sun"], ids=["a"])
    queries = ["tree under blue sky", "river water"]
    vectors = enc.encode_queries(queries)
    for scoring in ("dice", "maxsim", "hybrid"):
        hits = index.search(queries, k=10, scoring=scoring)
        assert_hits_equal(hits, brute_force(index, vectors, 10, scoring), atol=1e-4)
        for h in (row[0] for row in hits):
            c = index.cu_doc_chunks[index.ids.index(h.id)] + h.chunk
            assert h.text == index.texts[index.ids.index(h.id)][index.chunk_start_char[c] : index.chunk_end_char[c]]
            assert h.text.strip()


def _one_vector_docs(n, dim=DIM):
    """n identical documents of one chunk each: every score ties."""
    v = np.tile(_unit(np.random.default_rng(7), 1), (n, 1))
    return ([f"d{i}" for i in range(n)], v, v, np.arange(n), np.zeros(n), np.ones(n), np.ones(n))


@pytest.mark.parametrize("block", [1 << 22, 50])
def test_ties_at_the_cut_off_keep_the_first_documents(block, monkeypatch):
    monkeypatch.setattr(top, "BLOCK_SCORES", block)  # 50: the running top k meets ties block after block
    index = DiceIndex(DIM, store_text=False)
    index.add_arrays(*_one_vector_docs(1000))
    for scoring in ("dice", "maxsim", "hybrid"):
        for k in (1, 3, 17):
            assert [h.id for h in index.search(_unit(np.random.default_rng(1), 2), k, scoring)[0]] == \
                [f"d{i}" for i in range(k)]


def test_a_refused_upsert_keeps_the_documents_it_would_replace():
    index, queries = _random_index()
    before = index.search(queries, 5)
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match=r"expected \(n, 16\) vectors"):
        index.upsert_arrays(["doc-0"], _unit(rng, 1)[:, :8], _unit(rng, 1)[:, :8], [0], [0], [1], [1])
    with pytest.raises(ValueError, match="duplicate id 'doc-1': ids.0. and ids.1."):
        index.upsert_arrays(["doc-1", "doc-1"], _unit(rng, 2), _unit(rng, 2), [0, 1], [0, 0], [1, 1], [1, 1])
    assert len(index) == 40 and index.search(queries, 5) == before


def test_default_ids_skip_ids_taken_after_a_delete():
    index = DiceIndex(DIM, store_text=False)
    ids, docs, chunks, *rest = _one_vector_docs(3)
    index.add_arrays(None, docs, chunks, *rest)
    index.delete(["0"])
    index.add_arrays(None, docs[:2], chunks[:2], [0, 1], [0, 0], [1, 1], [1, 1])
    assert index.ids == ["1", "2", "3", "4"]


def test_default_ids_are_the_first_free_numbers_without_walking_the_taken_ones_again():
    """Each add with default ids walked every taken id from len(index) on: after deleting half of an index,
    every later add cost time in proportion to what was deleted (a reviewer: 26 ms an add at 100k
    deleted). The ids chosen are the rule's (first free numbers from len(index)) through random adds,
    deletes and a reload; the walk is the add's own size."""

    class Counting(set):
        looked = 0

        def __contains__(self, item):
            Counting.looked += 1
            return super().__contains__(item)

    rng = np.random.default_rng(7)
    index = DiceIndex(DIM, store_text=False)
    for step in range(60):
        n = int(rng.integers(1, 6))
        if step % 4 == 3:
            index.delete(rng.choice(index.ids, size=min(len(index), n), replace=False).tolist() + ["007", "x"])
        elif step == 30:
            index = pickle.loads(pickle.dumps(index))
        else:
            _, docs, chunks, *rest = _one_vector_docs(n)
            taken, want = set(index.ids), []
            j = len(index)
            while len(want) < n:
                want += [str(j)] * (str(j) not in taken)
                j += 1
            index.add_arrays(None, docs, chunks, *rest)
            assert index.ids[-n:] == want, step
    _, docs, chunks, *rest = _one_vector_docs(400)
    index = DiceIndex(DIM, store_text=False)
    index.add_arrays(None, docs, chunks, *rest)
    index.delete([str(i) for i in range(200)])  # "200" ... "399" left: the walk from len(index) meets them
    index._id_set = Counting(index._id_set)
    for _ in range(20):
        index.add_arrays(None, docs[:1], chunks[:1], *[a[:1] for a in rest])
    assert index.ids[-20:] == [str(i) for i in range(400, 420)]
    assert Counting.looked < 300, Counting.looked  # the 200 taken once, then ~2 a document; was 200 an add


def test_non_finite_vectors_and_ids_utf8_cannot_hold_are_refused_by_name():
    index = DiceIndex(DIM, store_text=False)
    ids, docs, chunks, *rest = _one_vector_docs(4)
    bad_doc, bad_chunk = docs.copy(), chunks.copy()
    bad_doc[2, 0], bad_chunk[3, 5] = np.nan, np.inf
    with pytest.raises(InputError, match=r"id 'd2' \(ids\[2\]\): its document vector holds NaN"):
        index.add_arrays(ids, bad_doc, chunks, *rest)
    with pytest.raises(InputError, match=r"id 'd3' \(ids\[3\]\): its chunk vector holds NaN"):
        index.add_arrays(ids, docs, bad_chunk, *rest)
    surrogate = json.loads('"doc\\udc00"')  # valid JSON, a lone surrogate
    with pytest.raises(InputError, match=r"ids\[1\]\) is not valid Unicode: surrogates not allowed at character 3"):
        index.add_arrays(["ok", surrogate], docs[:2], chunks[:2], [0, 1], [0, 0], [1, 1], [1, 1])
    assert len(index) == 0


def test_approximate_search_returns_k_documents_however_many_chunks_each_holds():
    pytest.importorskip("faiss")
    rng = np.random.default_rng(0)
    n, per = 300, 20  # a document's 20 chunks lie close together: the nearest chunks fall in few documents
    base = _unit(rng, n)
    chunks = np.repeat(base, per, 0) + 0.05 * rng.standard_normal((n * per, DIM)).astype(np.float32)
    index = DiceIndex(DIM, store_text=False)
    index.add_arrays([str(i) for i in range(n)], base, chunks, np.repeat(np.arange(n), per), np.zeros(n * per),
                     np.ones(n * per), np.ones(n * per))
    queries = _unit(rng, 3)
    for scoring in ("dice", "maxsim", "hybrid"):
        for k, candidates in ((10, 100), (50, 100), (30, 5)):
            hits = index.search(queries, k, scoring, approximate=True, candidates=candidates)
            assert [len(row) for row in hits] == [k] * 3
            assert all(len({h.id for h in row}) == k for row in hits)
    assert [len(r) for r in index.search(queries, n + 5, "maxsim", approximate=True)] == [n] * 3


# --- amortised growth, batched rescoring, score-only ranking: the same results as the plain code paths

def _raw(n_docs=60, seed=0):
    """`add_arrays` arguments of n_docs documents (0..5 chunks each, doc-3 none), chunks not unit length."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, n_docs)
    counts[3] = 0
    n_chunks = int(counts.sum())
    start = rng.integers(0, 100, n_chunks)
    return ([f"doc-{i}" for i in range(n_docs)], _unit(rng, n_docs), 3 * _unit(rng, n_chunks),
            np.repeat(np.arange(n_docs), counts), start, start + rng.integers(1, 50, n_chunks),
            rng.integers(1, 9, n_chunks))


def _batch(raw, docs):
    """The `add_arrays` batch of documents ``docs`` (indices into ``raw``) in that order."""
    ids, documents, chunks, doc_of, start, end, tokens = raw
    rows = np.concatenate([np.zeros(0, np.int64)] + [np.flatnonzero(doc_of == d) for d in docs])
    new_doc = np.repeat(np.arange(len(docs)), [np.count_nonzero(doc_of == d) for d in docs])
    return [ids[d] for d in docs], documents[docs], chunks[rows], new_doc, start[rows], end[rows], tokens[rows]


def _built(raw, docs, chunk_dtype="float32"):
    """An index of documents ``docs`` added in one batch."""
    index = DiceIndex(DIM, store_text=False, chunk_dtype=chunk_dtype)
    index.add_arrays(*_batch(raw, docs))
    return index


def _same_index(a: DiceIndex, b: DiceIndex):
    assert a.ids == b.ids and len(a) == len(b) and a.n_chunks == b.n_chunks and a.nbytes == b.nbytes
    for name in ("documents", "chunks", "cu_doc_chunks", "chunk_start_char", "chunk_end_char", "chunk_tokens"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name


@pytest.mark.parametrize("chunk_dtype", ["float32", "float16"])
def test_many_small_adds_equal_one_big_add_and_arrays_read_before_stay_whole(chunk_dtype, tmp_path):
    raw, queries = _raw(), _unit(np.random.default_rng(1), 5)
    whole = _built(raw, list(range(60)), chunk_dtype)
    grown = DiceIndex(DIM, store_text=False, chunk_dtype=chunk_dtype)
    held = []
    for lo, hi in ((0, 1), (1, 2), (2, 5), (5, 17), (17, 18), (18, 40)):  # sizes 1..22: buffers double in between
        grown.add_arrays(*_batch(raw, list(range(lo, hi))))
        held.append((hi, grown.chunks, grown.cu_doc_chunks.copy(), grown.chunks.copy()))
        _same_index(grown, _built(raw, list(range(hi)), chunk_dtype))
        assert grown.search(queries, 7) == _built(raw, list(range(hi)), chunk_dtype).search(queries, 7)
    grown.save(tmp_path / "ix")
    loaded = DiceIndex.load(tmp_path / "ix")  # memory-mapped: the next add copies into memory
    for index in (grown, loaded):
        index.add_arrays(*_batch(raw, list(range(40, 60))))
        _same_index(index, whole)
        for scoring in ("dice", "maxsim", "hybrid"):
            assert index.search(queries, 9, scoring, alpha=0.3) == whole.search(queries, 9, scoring, alpha=0.3)
    for hi, chunks, cu, copy in held:  # an array read before an add is unchanged by it
        assert len(chunks) == cu[hi] and chunks.tobytes() == copy.tobytes()
    _same_index(DiceIndex.load(tmp_path / "ix"), _built(raw, list(range(40)), chunk_dtype))


@pytest.mark.parametrize("min_runs", [64, 0])  # 0: a delete gathers kept rows instead of copying runs
def test_replacing_upserts_and_deletes_equal_an_index_built_in_their_final_order(min_runs, monkeypatch):
    from dice_fast.index import growth

    monkeypatch.setattr(growth, "_MIN_RUNS", min_runs)
    raw, queries = _raw(), _unit(np.random.default_rng(1), 5)
    index = _built(raw, list(range(60)))
    before, before_copy = index.chunks, index.chunks.copy()
    assert index.delete([f"doc-{i}" for i in range(0, 60, 7)] + ["no-such-id"]) == 9
    assert before.tobytes() == before_copy.tobytes()  # the delete wrote new arrays
    replaced = [5, 3, 58, 59]  # re-added at the end, in this order
    index.upsert_arrays(*_batch(raw, replaced[:1]))
    index.upsert_arrays(*_batch(raw, replaced[1:]))
    index.add_arrays(*_batch(raw, [0]))
    order = [d for d in range(60) if d % 7 and d not in replaced] + replaced + [0]
    want = _built(raw, order)
    _same_index(index, want)
    for scoring in ("dice", "maxsim", "hybrid"):
        assert index.search(queries, 60, scoring, alpha=0.6) == want.search(queries, 60, scoring, alpha=0.6)
    many = [f"doc-{d}" for d in order[::2]]  # scattered: many runs of kept rows
    assert index.delete(many) == len(many)
    _same_index(index, _built(raw, order[1::2]))
    assert index.delete(index.ids) == len(order[1::2]) and index.n_chunks == 0
    index.add_arrays(*_batch(raw, [10, 11]))
    _same_index(index, _built(raw, [10, 11]))


def _per_pair_scores(index, q, pairs, scoring, alpha):
    """What approximate search computed before: each (query, document) scored alone."""
    from dice_fast import scoring as sc

    cu = index.cu_doc_chunks
    return np.array([sc.score(scoring, q[i : i + 1], index.documents[d : d + 1], index.chunks[cu[d] : cu[d + 1]],
                              cu[d : d + 2] - cu[d], alpha)[0][0, 0] for i, d in pairs])


@pytest.mark.parametrize("chunk_dtype", ["float32", "float16"])
def test_batched_rescoring_equals_scoring_each_pair_alone_bit_for_bit(chunk_dtype, monkeypatch):
    from dice_fast.index import rescore

    index, _ = _random_index(n_docs=80, chunk_dtype=chunk_dtype)  # 0..5 chunks each, doc-3 none
    rng = np.random.default_rng(5)
    q = _unit(rng, 6)
    wide = np.zeros((6, 3 * DIM), np.float32)
    wide[:, : 2 * DIM : 2] = q
    pairs = [(int(i), int(d)) for i, d in zip(rng.integers(0, 6, 300), rng.integers(0, 80, 300))] + [(0, 3)]
    pq, pd = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    # query rows contiguous, or with gaps (Fortran order, a strided view: numpy multiplies those without BLAS)
    for q, block in ((q, 1 << 22), (q, 5), (np.asfortranarray(q), 1 << 22), (wide[:, : 2 * DIM : 2], 5)):
        monkeypatch.setattr(rescore, "_BLOCK_VALUES", block)  # 5: every stacked product holds one pair
        for scoring, alpha in (("dice", 0.0), ("maxsim", 0.0), ("hybrid", 0.4), ("hybrid", 1.0)):
            got = rescore.pair_scores(q, index.documents, index.chunks, index.cu_doc_chunks, pq, pd, scoring, alpha)
            want = _per_pair_scores(index, q, pairs, scoring, alpha)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (scoring, alpha)


def test_approximate_search_rescores_as_each_pair_alone():
    pytest.importorskip("faiss")
    index, _ = _random_index(n_docs=200)
    queries = _unit(np.random.default_rng(9), 7)
    for scoring in ("dice", "maxsim", "hybrid"):
        proposed = index._proposed(queries, 20, "documents" if scoring == "dice" else "chunks", 20)
        top = index._approximate_top(queries, 20, scoring, 0.3, 20)
        for i, (docs, row) in enumerate(zip(proposed, top)):
            assert docs is not None and len(row) == 20
            scores = _per_pair_scores(index, queries, [(i, d) for d in docs], scoring, 0.3)
            order = np.lexsort((docs, -scores))[:20]  # the old ranking: by score, ties by document order
            assert row == [(int(docs[j]), float(scores[j])) for j in order]


def test_score_only_equals_the_score_of_score():
    from dice_fast import scoring as sc

    index, queries = _random_index(n_docs=50)
    chunks = index.chunks.copy()
    chunks[4, 2] = np.nan  # a NaN chunk score is skipped by both
    for scoring in sc.SCORINGS:
        want, _ = sc.score(scoring, queries, index.documents, chunks, index.cu_doc_chunks, 0.25)
        got = sc.score_only(scoring, queries, index.documents, chunks, index.cu_doc_chunks, 0.25)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    best, _ = sc.best_chunks(sc.chunk_scores(queries, chunks), index.cu_doc_chunks)
    assert best.tobytes() == sc.best_chunk_scores(sc.chunk_scores(queries, chunks), index.cu_doc_chunks).tobytes()


def test_a_text_columns_take_copies_bytes_and_keeps_every_text():
    """`TextColumn.take` (what a delete or a replacing upsert keeps) copies byte runs of the blob, not
    one decoded string per document (it turned a memory-mapped index's texts into Python strings)."""
    from dice_fast.index.texts import TextColumn

    texts = ["alpha", "", "βγδ 🙂", "x" * 1000, "last\nline"]
    stored = TextColumn(*TextColumn.from_texts(texts).arrays())  # as loaded: blob and offsets
    stored.extend(["added one", "äöü"])
    every = texts + ["added one", "äöü"]
    rng = np.random.default_rng(3)
    for keep in ([], [0], [6], [1, 2, 3], [0, 2, 4, 5, 6], [6, 0, 3], list(rng.permutation(7))):
        got = stored.take(np.array(keep, np.int64))
        assert list(got) == [every[i] for i in keep], keep
        assert len(got.arrays()[0]) == sum(len(every[i].encode()) for i in keep)


def test_a_document_without_chunks_adds_to_a_memory_mapped_index(tmp_path):
    """Its zero chunk rows were written into the read-only memory-mapped buffer: a ValueError after
    the ids, documents and offsets had grown (half added; a retry said "duplicate id")."""
    rng = np.random.default_rng(0)
    ix = DiceIndex(8, store_text=False)
    ix.add_arrays(["a", "b"], rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32),
                  np.array([0, 0, 1]), np.zeros(3, np.int64), np.ones(3, np.int64), np.ones(3, np.int64))
    ix.save(tmp_path / "ix")
    loaded = DiceIndex.load(tmp_path / "ix")  # mmap=True
    loaded.add_arrays(["empty"], rng.standard_normal((1, 8)).astype(np.float32), np.zeros((0, 8), np.float32),
                      np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert loaded.ids == ["a", "b", "empty"] and loaded.cu_doc_chunks.tolist() == [0, 2, 3, 3]
    assert len(loaded.documents) == 3 and loaded.n_chunks == 3


def test_output_ids_are_checked_streaming_and_named_by_file_and_row(monkeypatch):
    """`check_output_ids` keeps 8 bytes per id (it held every id of every shard, and a dict of them);
    a repeat names both rows, and two ids that only share a 64-bit hash are no repeat."""
    from dice_fast.errors import InputError
    from dice_fast.id_set import IdSet
    from dice_fast.index.common import check_output_ids

    shards = {"a.parquet": [["x", "y"]], "b.parquet": [["z"], ["w", "y"]]}  # row groups
    with pytest.raises(InputError, match=r"duplicate id 'y': a\.parquet row 1 and b\.parquet row 2"):
        check_output_ids(list(shards), shards.__getitem__)
    shards["b.parquet"][1][1] = "v"
    assert check_output_ids(list(shards), shards.__getitem__) == 5
    real = IdSet.add
    monkeypatch.setattr(IdSet, "add", lambda self, ids: real(self, ids) + (["x"] if "w" in ids else []))  # a collision
    assert check_output_ids(list(shards), shards.__getitem__) == 5


def _window_encoder(monkeypatch):
    from dice_fast import engine

    monkeypatch.setattr(engine, "_WINDOW_DOCUMENTS", 3)  # windows of three documents
    model, tok = tiny("bert")[:2]
    return DiceEncoder(model, tok, chunk_size=4, pooling="mean", pooling_impl="torch")


STREAM_TEXTS = [f"text {i} " + "red tree blue sky river " * (i % 5) for i in range(24)]


def test_add_reads_texts_a_window_at_a_time_and_equals_adding_a_list(monkeypatch):
    enc = _window_encoder(monkeypatch)
    whole = DiceIndex.from_texts(enc, STREAM_TEXTS, [f"d{i}" for i in range(24)])
    index, ahead = DiceIndex(enc.dim, enc), []

    def texts():
        for i, text in enumerate(STREAM_TEXTS):
            ahead.append(i - len(index))  # texts read but not yet in the index
            yield text

    index.add(texts(), (f"d{i}" for i in range(24)))
    # the window being read and two read ahead (one planned, one encoded), not the input
    assert max(ahead) < 3 * 3 and len(index) == 24
    assert index.ids == whole.ids and index.texts[5] == STREAM_TEXTS[5]
    for name in ("documents", "chunks", "cu_doc_chunks", "chunk_start_char", "chunk_end_char", "chunk_tokens"):
        np.testing.assert_array_equal(getattr(index, name), getattr(whole, name), err_msg=name)


@pytest.mark.parametrize("case", ["not a string", "more texts", "fewer texts", "list count"])
def test_an_add_refused_midway_leaves_the_index_as_it_was(case, monkeypatch):
    enc = _window_encoder(monkeypatch)
    index = DiceIndex.from_texts(enc, ["first"], ["a"])
    before = (list(index.ids), index.documents.copy(), index.chunks.copy())
    texts = iter(STREAM_TEXTS[:7] + ([None] if case == "not a string" else []))
    ids = [f"d{i}" for i in range({"not a string": 8, "more texts": 5, "fewer texts": 9, "list count": 6}[case])]
    error, match = {"not a string": (TypeError, r"documents\[7\] is NoneType"),
                    "more texts": (ValueError, r"got 5 ids for more documents \(texts\[5\] has none\)"),
                    "fewer texts": (ValueError, "got 9 ids for 7 documents"),
                    "list count": (ValueError, "got 6 ids for 7 documents")}[case]
    with pytest.raises(error, match=match):
        index.add(list(texts) if case == "list count" else texts, ids)
    assert (index.ids, index.documents.tolist(), index.chunks.tolist()) == (before[0], before[1].tolist(),
                                                                            before[2].tolist())
    assert len(index.texts) == 1 and index.search(["first"], k=5)[0][0].id == "a"


def test_a_single_string_is_refused_not_read_character_by_character(monkeypatch):
    enc = _window_encoder(monkeypatch)
    index = DiceIndex(enc.dim, enc)
    for ids in (None, ["a"]):
        with pytest.raises(TypeError, match="texts must be an iterable of strings, not a single str"):
            index.add("one long document", ids)
    assert len(index) == 0


def test_exact_top_ranks_nan_scores_last():
    """A NaN score (only from overflowing vectors) ranks last, whether or not the top k is cut."""
    from dice_fast.index.top import exact_top

    s = np.array([[0.5, np.nan, 0.9, 0.1, np.nan]])
    score_range = lambda q, d0, d1, scoring, alpha: s[:, d0:d1]  # noqa: E731
    cu, q = np.arange(6, dtype=np.int64), np.zeros((1, 4), np.float32)
    assert exact_top(score_range, cu, q, 2, "dice", 0.0) == [[(2, 0.9), (0, 0.5)]]
    full = exact_top(score_range, cu, q, 5, "dice", 0.0)[0]
    assert [d for d, _ in full] == [2, 0, 3, 1, 4] and [v for _, v in full[3:]] == [-np.inf, -np.inf]
