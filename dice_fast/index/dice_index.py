"""`DiceIndex`: document vectors, chunk vectors and chunk spans of a corpus, searched exactly.

Memory (dim = the model width, e.g. 384 for all-MiniLM-L6-v2):

* per document: ``4 * dim`` bytes (its float32 vector) + 8 (its chunk offset) + its id, and its text
  when stored (``store_text=True``);
* per chunk: ``4 * dim`` bytes (float32) or ``2 * dim`` (``chunk_dtype="float16"``) + 24 (start
  character, end character and token count, int64).

For MiniLM with chunks of 256 tokens that is 1,544 bytes per document and 1,560 (float32) or 792
(float16) per chunk: a 2,000-token document with 8 chunks holds about 14 kB (float32) or 7.9 kB.

Exact search (the default) scores blocks of documents by one matrix product each, keeping a running
top k (ties by document order): memory is bounded by the block, not the corpus (`dice_fast.index.top`).
With ``approximate=True`` a faiss HNSW graph (extra ``index``: faiss-cpu) proposes documents per query:
its ``max(candidates, k)`` nearest vectors (document vectors for ``dice``; chunk vectors for
``maxsim`` and ``hybrid``, a document being proposed when one of its chunks is), doubled
until they propose ``min(k, n)`` documents; a query still short when the search spans the whole graph
is answered exactly. The proposed documents are scored exactly and ``min(k, n)`` come back: a hit's
score is exact, but a document the graph does not propose is missed (recall < 1).
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np

from .. import scoring as sc
from ..config import checked_integer
from ..errors import InputError, OptionError
from ..streaming import as_iterator
from .ann import Graphs
from .growth import COLUMNS, Column, Grown, grown
from .rescore import pair_scores
from .rwlock import ReadWriteLock
from .common import (DEFAULT_SCORING, EncoderSlot, Hit, check_batch, check_ids, check_k, check_output_ids, evidence_hit,
                     free_numbers, lookup_ids, lowest_number, scored_hits)
from .texts import TextColumn
from .top import by_score, exact_top

CHUNK_DTYPES = {"float32": np.float32, "float16": np.float16}


class DiceIndex(EncoderSlot):
    """Document and chunk vectors of a corpus with their spans (see the module docstring).

    Build with `from_texts` (and `add`) or `from_arrays`; `search` ranks documents for queries;
    `save` / `load` keep it in a folder. ``encoder`` (a `DiceEncoder`) is needed only to add texts
    and to search by query strings; a loaded index gets one with ``load(path, encoder)``.

    The arrays below are the filled parts of buffers that double when full (`dice_fast.index.growth`),
    so adding documents batch by batch costs time linear in the documents added, not in the index.

    Thread-safe: searches, `contains` and `save` run side by side; `add` (once its texts are
    encoded), `add_arrays`, `upsert_arrays` and `delete` run alone (`dice_fast.index.rwlock`), so a
    search sees the index before or after a write, never half of one.
    """

    documents, chunks, cu_doc_chunks = Column(), Column(), Column()
    chunk_start_char, chunk_end_char, chunk_tokens = Column(), Column(), Column()

    def __init__(self, dim: int, encoder=None, *, store_text: bool = True, chunk_dtype: str = "float32",
                 model: str | None = None, encoder_options: dict | None = None):
        if chunk_dtype not in CHUNK_DTYPES:
            raise OptionError(f"chunk_dtype must be one of {', '.join(CHUNK_DTYPES)}, got {chunk_dtype!r}")
        self.dim, self.store_text, self.chunk_dtype = int(dim), bool(store_text), chunk_dtype
        self.ids: list[str] = []
        self.texts: TextColumn | None = TextColumn.from_texts([]) if store_text else None
        self.documents = np.zeros((0, self.dim), np.float32)
        self.chunks = np.zeros((0, self.dim), CHUNK_DTYPES[chunk_dtype])
        self.cu_doc_chunks = np.zeros(1, np.int64)
        self.chunk_start_char, self.chunk_end_char, self.chunk_tokens = (np.zeros(0, np.int64) for _ in range(3))
        self._id_set: set[str] = set()
        self._taken_to = 0  # every default id from len(self) up to this number is taken (where their scan starts)
        self._graphs = Graphs()  # for approximate search
        self._lock = ReadWriteLock()  # searches share it, writes hold it alone
        self._init_encoder(encoder, model, encoder_options, "this index")

    # ---------------------------------------------------------------------------------------------
    @classmethod
    def from_texts(cls, encoder, texts: Iterable[str], ids: Sequence | None = None, *, store_text: bool = True,
                   chunk_dtype: str = "float32") -> DiceIndex:
        """Encode ``texts`` (n_docs strings) with ``encoder`` and index them under ``ids`` (n_docs,
        default "0", "1", ...)."""
        index = cls(encoder.dim, encoder, store_text=store_text, chunk_dtype=chunk_dtype)
        index.add(texts, ids)
        return index

    @classmethod
    def from_corpus(cls, path, encoder=None, *, chunk_dtype: str = "float32") -> DiceIndex:
        """Index the output of ``dice-fast encode INPUT -o PATH --chunks`` (a .parquet file or a shard
        folder). Such an output holds no texts: hits carry spans, and ``text`` is None."""
        from .corpus_output import corpus_encoder, corpus_files, read_corpus_parts, read_ids

        model, options, dim = corpus_encoder(path)
        files = corpus_files(path)
        if not files:
            raise InputError(f"{path}: the output holds no shards")
        check_output_ids(files, read_ids)  # before anything is read whole
        index = cls(dim, encoder, store_text=False, chunk_dtype=chunk_dtype, model=model,
                    encoder_options=options)
        for file in files:  # row group by row group: memory of the index and one row group
            for ids, documents, chunks, chunk_document, start, end, tokens in read_corpus_parts(file):
                index.add_arrays(ids, documents, chunks, chunk_document, start, end, tokens)
        return index

    def add(self, texts: Iterable[str], ids: Iterable | None = None) -> None:
        """Encode and append ``texts`` (any iterable of n strings: a list, a generator, a file reader)
        under ``ids`` (n, default "0", "1", ... counting from the index's size and skipping ids taken).
        A duplicate id (within ``ids`` or already indexed) is refused by name before anything is
        encoded. Texts are read, encoded and appended a window at a time: memory is the index and one
        window, and searches meanwhile see the windows appended so far. A failure midway (a text that
        is not a string, more or fewer texts than ids) removes them again: the index is as it was."""
        if isinstance(texts, (str, bytes)):
            as_iterator(texts, "texts")  # raises, naming the mistake (before the ids are counted against it)
        if ids is not None:
            ids = check_ids(ids)  # any iterable, never one string (read a character at a time)
            if hasattr(texts, "__len__") and len(texts) != len(ids):
                raise OptionError(f"got {len(ids)} ids for {len(texts)} documents")
            with self._lock.reading():
                self._new_ids(ids, len(ids))  # refused before encoding (and checked again when written)
        added: list[str] = []
        try:
            for window, out in self._encoded_windows(texts):  # encoded outside the lock: searches go on
                part = None if ids is None else ids[len(added) : len(added) + len(window)]
                if part is not None and len(part) < len(window):
                    raise OptionError(f"got {len(ids)} ids for more documents (texts[{len(ids)}] has none)")
                with self._lock.writing():
                    added += self._add_arrays(part, out.documents, out.chunks, out.chunk_document,
                                              out.chunk_start_char, out.chunk_end_char, out.chunk_end - out.chunk_start,
                                              window if self.store_text else None)
                    self._record_encoder()
            if ids is not None and len(added) != len(ids):
                raise OptionError(f"got {len(ids)} ids for {len(added)} documents")
        except BaseException:
            with self._lock.writing():
                self._delete(added)
            raise

    def add_arrays(self, ids: Sequence, documents: np.ndarray, chunks: np.ndarray, chunk_document: np.ndarray,
                   chunk_start_char: np.ndarray, chunk_end_char: np.ndarray, chunk_tokens: np.ndarray,
                   texts: Sequence[str] | None = None) -> None:
        """Append encoded documents: ids (n,), documents (n, dim), chunks (n_chunks, dim) with
        chunk_document (n_chunks,) sorted document index in ``0..n-1`` and the chunks' spans and token
        counts (n_chunks,) each, as `DiceOutput` gives them; texts (n,) when the index stores them.
        Chunk vectors are stored L2-normalised, so ``maxsim`` is a cosine whatever the encoder's
        ``normalize_chunks`` (raw pooled norms carry no relevance: RESULTS.md §5.3); a zero row stays zero.
        A chunk of 0 tokens (an empty text's chunk of special tokens alone) is not stored: evidence of
        nothing (`check_batch`)."""
        with self._lock.writing():
            self._add_arrays(ids, documents, chunks, chunk_document, chunk_start_char, chunk_end_char, chunk_tokens,
                             texts)

    def _add_arrays(self, ids, documents, chunks, chunk_document, chunk_start_char, chunk_end_char, chunk_tokens,
                    texts) -> list[str]:
        """`add_arrays` under the write lock held; returns the ids given (or made)."""
        ids = self._new_ids(ids, len(documents))
        self._append(check_batch(self.dim, ids, documents, chunks, chunk_document, chunk_start_char, chunk_end_char,
                                 chunk_tokens, texts, self.store_text))
        return ids

    def _append(self, b) -> None:
        """Append a checked `Batch` whose ids are not indexed."""
        chunks = b.chunks.astype(CHUNK_DTYPES[self.chunk_dtype], copy=False)
        if self.store_text:
            self.texts.extend(b.texts)
        self.ids.extend(b.ids)
        self._id_set.update(b.ids)
        # into the columns' buffers (`growth.Grown`): the index is copied only when a buffer doubles
        grown(self, "cu_doc_chunks").append(b.cu[1:] + self.cu_doc_chunks[-1])
        for name, rows in (("documents", b.documents), ("chunks", chunks), ("chunk_start_char", b.start),
                           ("chunk_end_char", b.end), ("chunk_tokens", b.tokens)):
            grown(self, name).append(rows)
        self._graphs.append(b.documents, chunks)

    def upsert_arrays(self, ids: Sequence, documents, chunks, chunk_document, chunk_start_char, chunk_end_char,
                      chunk_tokens, texts: Sequence[str] | None = None) -> None:
        """`add_arrays`, a document whose id is already indexed replacing it (the stores' write). A
        batch refused (its shapes, its own duplicate ids) leaves the index as it was."""
        b = check_batch(self.dim, ids, documents, chunks, chunk_document, chunk_start_char, chunk_end_char,
                        chunk_tokens, texts, self.store_text)
        with self._lock.writing():
            self._delete(b.ids)
            self._append(b)

    def contains(self, ids: Sequence) -> list[bool]:
        """For each id in ``ids``: whether the index holds it (as `QdrantStore` / `LanceStore` answer)."""
        ids = lookup_ids(ids)
        with self._lock.reading():
            return [i in self._id_set for i in ids]

    def delete(self, ids: Sequence) -> int:
        """Remove the documents ``ids`` (ids not indexed are ignored); returns how many were removed."""
        ids = lookup_ids(ids)
        with self._lock.writing():
            return self._delete(ids)

    def _delete(self, ids: list[str]) -> int:
        gone = set(ids) & self._id_set
        if not gone:
            return 0
        keep = ~np.fromiter(map(gone.__contains__, self.ids), bool, len(self.ids))
        counts = np.diff(self.cu_doc_chunks)
        keep_chunk = np.repeat(keep, counts)
        self.ids = list(itertools.compress(self.ids, keep.tolist()))
        self._id_set -= gone
        self._taken_to = lowest_number(gone, below=self._taken_to)
        if self.store_text:
            self.texts = self.texts.take(np.flatnonzero(keep))
        cu = np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64)
        for name in COLUMNS:
            # new buffers (an array read before stays whole) with the old capacity (upsert appends next)
            if name == "cu_doc_chunks":
                self.cu_doc_chunks = Grown(cu, len(grown(self, name).buffer))
            else:
                setattr(self, name, grown(self, name).compress(keep if name == "documents" else keep_chunk))
        self._graphs = Graphs()  # rebuilt when next needed
        return len(gone)

    def restore(self, ids: list[str], arrays: dict, texts: TextColumn | None, graph_files: dict) -> None:
        """Install contents read by `dice_fast.index.folder.load` (checked there): ids, the arrays by
        attribute name, the texts or None, and {over: saved graph file}."""
        with self._lock.writing():
            self._restore(ids, arrays, texts, graph_files)

    def _restore(self, ids, arrays, texts, graph_files) -> None:
        for name, array in arrays.items():
            setattr(self, name, array)
        self.ids, self._id_set, self._taken_to = ids, set(ids), 0
        self.texts = texts
        self._graphs = Graphs(graph_files)

    def __getstate__(self) -> dict:
        """Pickled (sent to a Ray worker, a process pool): one moment of the index, without its lock,
        its encoder (the recorded one is loaded when first needed) or built faiss graphs (rebuilt)."""
        with self._lock.reading():
            state = dict(vars(self))
            state["texts"] = None if self.texts is None else TextColumn(*self.texts.arrays())
            state["ids"], state["_id_set"] = list(self.ids), set(self._id_set)
            state.update((name, getattr(self, name)) for name in COLUMNS)  # the filled parts only
        del state["_lock"]
        state["encoder"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        for name in COLUMNS:
            setattr(self, name, state.pop(name))
        vars(self).update(state)
        self._lock = ReadWriteLock()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def nbytes(self) -> int:
        """Bytes held by the vectors and spans (ids and texts not counted)."""
        return sum(getattr(self, name).nbytes for name in COLUMNS)

    def __repr__(self) -> str:
        return (f"DiceIndex({len(self)} documents, {self.n_chunks} chunks, dim={self.dim}, "
                f"chunk_dtype={self.chunk_dtype}, texts={'stored' if self.store_text else 'not stored'})")

    # ---------------------------------------------------------------------------------------------
    def search(self, queries, k: int = 10, scoring: str = DEFAULT_SCORING, *, alpha: float = sc.DEFAULT_ALPHA,
               approximate: bool = False, candidates: int = 100) -> list[list[Hit]]:
        """Rank documents for ``queries``: n query strings (encoded with the index's encoder) or an
        (n, dim) array of query vectors. Returns n lists of at most ``k`` `Hit`s, best first (equal scores in
        insertion order; two identical documents may score ~1e-8 apart, the matrix product's rounding
        depending on a row's place, and so come in either order). A document without chunks (an empty text) has no maxsim score: ``maxsim`` and
        ``hybrid`` with ``alpha < 1`` never return it.

        scoring: "maxsim" (best chunk; the default, measured best: RESULTS.md §5), "dice" (document
        vector; evidence = the hit's best chunk) or "hybrid" (``alpha * dice + (1 - alpha) * maxsim``; the other
        scorings ignore ``alpha``), see `dice_fast.scoring`. Exact unless
        ``approximate`` (faiss proposes documents from at least ``candidates`` vectors per query,
        widened until ``k`` documents are proposed, and they are scored exactly: module docstring).
        """
        sc.check_scoring(scoring)
        alpha = sc.check_alpha(alpha)
        k = check_k(k)
        candidates = checked_integer("candidates", candidates)  # True or 2.7 were taken as 1 and 2
        q = self._query_vectors(queries)  # encoded outside the lock: writes go on meanwhile
        with self._lock.reading():
            if len(q) == 0 or len(self) == 0:
                return [[] for _ in range(len(q))]
            if approximate:
                top = self._approximate_top(q, k, scoring, alpha, candidates)
            else:
                top = exact_top(self._score_range, self.cu_doc_chunks, q, k, scoring, alpha)
            return [[self._hit(qv, d, s) for d, s in scored_hits(scoring, row)] for qv, row in zip(q, top)]

    def _score_range(self, q, d0: int, d1: int, scoring: str, alpha: float) -> np.ndarray:
        """(n_q, d1 - d0) scores of documents d0..d1-1 (no evidence: it is found for hits only)."""
        if scoring == "dice":
            return sc.dice(q, self.documents[d0:d1])[0]
        c0, c1 = self.cu_doc_chunks[d0], self.cu_doc_chunks[d1]
        return sc.score_only(scoring, q, self.documents[d0:d1], self.chunks[c0:c1],
                             self.cu_doc_chunks[d0 : d1 + 1] - c0, alpha)

    def _approximate_top(self, q, k: int, scoring: str, alpha: float, candidates: int):
        proposed = self._proposed(q, k, "documents" if scoring == "dice" else "chunks", candidates)
        short = [i for i, docs in enumerate(proposed) if docs is None]
        exact = {}
        if short:
            exact = dict(zip(short, exact_top(self._score_range, self.cu_doc_chunks, q[short], k, scoring, alpha)))
        # every proposed (query, document) pair scored at once, each score as scoring it alone gives
        sizes = [0 if docs is None else len(docs) for docs in proposed]
        pair_q = np.repeat(np.arange(len(q)), sizes)
        pair_d = np.concatenate([np.zeros(0, np.int64)] + [docs for docs in proposed if docs is not None])
        scores = np.split(pair_scores(q, self.documents, self.chunks, self.cu_doc_chunks, pair_q, pair_d, scoring,
                                      alpha), np.cumsum(sizes)[:-1])
        out = []
        for i, (docs, s) in enumerate(zip(proposed, scores)):
            if docs is None:
                out.append(exact[i])
                continue
            order = np.argsort(-s, kind="stable")[:k]
            out.append(by_score(docs[order], s[order]))
        return out

    def _proposed(self, q, k: int, over: str, candidates: int) -> list:
        """Per query the sorted distinct documents the graph over ``over`` proposes among its nearest
        ``max(candidates, k)`` vectors, the search widened (doubling) until they are ``min(k, n)``
        documents; None for a query still short when the search spans the whole graph."""
        graph = self._faiss_graph(over)
        want, cu = min(k, len(self)), self.cu_doc_chunks
        found: list = [None] * len(q)
        todo, width = list(range(len(q))), max(candidates, k)
        while todo and graph.ntotal:
            width = min(width, graph.ntotal)
            _, rows = graph.search(np.ascontiguousarray(q[todo], np.float32), width)
            for i, row in zip(todo, rows):
                row = row[row >= 0]
                found[i] = np.unique(row if over == "documents" else np.searchsorted(cu, row, side="right") - 1)
            todo = [i for i in todo if len(found[i]) < want]
            if width == graph.ntotal:
                break
            width *= 2
        for i in todo:
            found[i] = None
        return found

    def _faiss_graph(self, over: str):
        return self._graphs.get(over, self.documents if over == "documents" else self.chunks)

    def build_graph(self, scoring: str = "maxsim"):
        """Build (or read) now the HNSW graph that ``approximate=True`` uses for ``scoring`` (over
        document vectors for "dice", chunk vectors otherwise), so that `save` writes it too."""
        with self._lock.reading():
            return self._faiss_graph("documents" if sc.check_scoring(scoring) == "dice" else "chunks")

    def graphs(self) -> dict:
        """{"documents" | "chunks": a faiss graph built or read so far, or the Path of a saved graph
        not read yet (still current: it is dropped when documents are added)}."""
        return self._graphs.current()

    def follow_saved_graphs(self, files: dict) -> None:
        """After `save` wrote ``files`` ({over: Path}): a saved graph not read yet is read from its new
        file from now on (the save removes the file it was loaded from)."""
        self._graphs.moved(files)

    def _hit(self, qv: np.ndarray, d: int, score: float) -> Hit:
        c0, c1 = int(self.cu_doc_chunks[d]), int(self.cu_doc_chunks[d + 1])
        return evidence_hit(self.ids[d], score, qv, self.chunks[c0:c1], self.chunk_start_char[c0:c1],
                            self.chunk_end_char[c0:c1], self.texts[d] if self.store_text else None)

    # ---------------------------------------------------------------------------------------------
    def _new_ids(self, ids, n: int) -> list[str]:
        if ids is None:  # "0", "1", ... from len(self) on, skipping ids taken (after a delete), walked once (locked)
            ids = free_numbers(self._id_set, max(len(self), self._taken_to), n)
            self._taken_to = int(ids[0]) if ids else self._taken_to
        ids = check_ids(ids, n)  # their count, duplicates within them
        for i, name in enumerate(ids):
            if name in self._id_set:
                raise OptionError(f"duplicate id {name!r}: ids[{i}] is already in the index (upsert_arrays replaces)")
        return ids

    def save(self, path) -> None:
        """Write the index to the folder ``path``, atomically (see `dice_fast.index.folder`); graphs
        built by `build_graph` or an approximate search are saved with it."""
        from .folder import save

        with self._lock.reading():  # one moment of the index: writes wait, searches go on
            save(self, path)

    @classmethod
    def load(cls, path, encoder=None, *, mmap: bool = True, device: str | None = None) -> DiceIndex:
        """Read an index written by `save`. ``encoder``: a `DiceEncoder` matching the recorded model
        and options (ValueError naming each difference); None: the recorded one is loaded when texts
        or query strings first need it (on ``device``). ``mmap``: map the vector and text files
        instead of reading them into memory (search pages them in; `add` copies into memory)."""
        from .folder import load

        return load(cls, path, encoder, mmap=mmap, device=device)
