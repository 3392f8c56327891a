"""What every store shares: the hit, the default scoring, the check of a batch of vectors to write,
the evidence of a hit, and the encoder slot (the recorded model and options, a matching encoder).

Every store (`DiceIndex`, `QdrantStore`, `LanceStore`) takes the same batch: ids (n,), documents
(n, dim), chunks (n_chunks, dim) with chunk_document (n_chunks,) sorted document index in 0..n-1,
the chunks' character spans and token counts (n_chunks,) each, and texts (n,) or None; and answers
``search(queries, k, scoring)`` with lists of `Hit`.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from .. import scoring as sc
from ..config import checked_integer
from ..errors import ArgumentTypeError, InputError, OptionError
from ..id_set import IdSet
from ..scoring import DEFAULT_SCORING
from ..streaming import as_iterator
from .encoder_match import check_encoder, model_id, recorded_model, recorded_options, restore_encoder, vector_options

__all__ = ["DEFAULT_SCORING", "Hit", "Batch", "check_batch", "check_ids", "check_k", "check_output_ids",
           "evidence_hit", "lookup_ids", "scored_hits", "storable", "EncoderSlot", "short_repr"]

# one recorded encoder is rebuilt at a time, process-wide: concurrent first searches (a retriever's
# batch, asyncio.gather) load the model once, and never import transformers from two threads at once
_RESTORE_LOCK = threading.Lock()


@dataclass(frozen=True)
class Hit:
    """One search result: document ``id`` with its ``score`` under the scoring asked for, and its
    evidence: ``chunk`` (index within the document), its span ``text[start_char:end_char]``, its
    ``chunk_score`` (query . unit chunk vector), and ``text``, the passage itself when the store keeps
    texts (else None). A document without chunks has chunk -1 and chunk_score -inf."""

    id: str
    score: float
    chunk: int
    start_char: int
    end_char: int
    chunk_score: float
    text: str | None = None


class Batch(NamedTuple):
    """A checked batch: ids (n,) distinct strings, documents (n, dim) float32, chunks (n_chunks, dim)
    float32 L2-normalised, cu (n + 1,) int64 chunk offsets, start, end, tokens (n_chunks,) int64,
    texts (n,) or None."""

    ids: list
    documents: np.ndarray
    chunks: np.ndarray
    cu: np.ndarray
    start: np.ndarray
    end: np.ndarray
    tokens: np.ndarray
    texts: list | None


def check_batch(dim: int, ids: Sequence, documents, chunks, chunk_document, chunk_start_char, chunk_end_char,
                chunk_tokens, texts: Sequence[str] | None, store_text: bool) -> Batch:
    """Validate and normalise a batch (see the module docstring); errors name the culprit. Chunk
    vectors come back L2-normalised so ``maxsim`` is a cosine whatever the encoder's
    ``normalize_chunks`` (raw pooled norms carry no relevance: RESULTS.md §5.3); a zero row stays zero.
    A chunk of no text (0 tokens: the one chunk of an empty or blank document, its special tokens
    alone) is left out: it is evidence of nothing, and its vector sat near every short query, so
    empty documents took the first places of a maxsim search. Such a document has no chunks."""
    documents, chunks = np.asarray(documents, np.float32), np.asarray(chunks)
    ids = check_ids(ids, len(documents))
    chunk_document = np.asarray(chunk_document, np.int64)
    if documents.ndim != 2 or documents.shape[1] != dim or chunks.ndim != 2 or chunks.shape[1] != dim:
        raise InputError(f"expected (n, {dim}) vectors, got documents {documents.shape}, chunks {chunks.shape}")
    if len(chunk_document) and (np.any(np.diff(chunk_document) < 0) or chunk_document[0] < 0
                                or chunk_document[-1] >= len(documents)):
        raise InputError("chunk_document must be sorted document indices in 0..n-1")
    spans = [np.asarray(a, np.int64) for a in (chunk_start_char, chunk_end_char, chunk_tokens)]
    if any(len(a) != len(chunks) for a in [chunk_document, *spans]):
        raise InputError("chunk_document, spans and token counts need one entry per chunk")
    for kind, vectors, owner in (("document", documents, None), ("chunk", chunks, chunk_document)):
        bad = sc.first_non_finite(vectors)
        if bad is not None:
            d = bad if owner is None else int(owner[bad])
            raise InputError(f"id {ids[d]!r} (ids[{d}]): its {kind} vector holds NaN or infinite values")
    if store_text:
        if texts is None or len(texts) != len(documents):
            raise InputError("this store keeps texts: pass one text per document")
        texts = list(texts)
        bad = next((j for j, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise ArgumentTypeError(f"texts[{bad}] is a {type(texts[bad]).__name__}, not a string")
        for j, text in enumerate(texts):
            _check_unicode(text, f"texts[{j}]")
    else:
        texts = None
    if not spans[2].all():
        keep = spans[2] != 0
        chunks, chunk_document, spans = chunks[keep], chunk_document[keep], [a[keep] for a in spans]
    cu = sc.cu_from_chunk_document(chunk_document, len(documents))
    return Batch(ids, documents, sc.unit_rows(chunks), cu, *spans, texts)


def free_numbers(taken: set, start: int, n: int) -> list[str]:
    """The first ``n`` of "start", "start + 1", ... that are not in ``taken`` (an index's default ids)."""
    return list(itertools.islice((str(j) for j in itertools.count(start) if str(j) not in taken), n))


def lowest_number(ids: Iterable[str], below: int) -> int:
    """The least of ``below`` and the ``ids`` that `free_numbers` could have made ("7", not "07" or "٧")."""
    return min([below] + [int(i) for i in ids if i.isdecimal() and str(int(i)) == i])


def check_ids(ids: Iterable, n: int | None = None) -> list[str]:
    """``ids`` (any iterable, never one string) as strings, one per document of ``n`` (None: as many as
    given), distinct and valid Unicode; `OptionError` naming the culprit otherwise (checked before
    anything is encoded or written)."""
    if ids is None:
        raise OptionError(f"ids are required: one per document ({n}); only DiceIndex numbers documents given none")
    ids = lookup_ids(ids)
    if n is not None and len(ids) != n:
        raise OptionError(f"got {len(ids)} ids for {n} documents")
    seen: dict[str, int] = {}
    for i, name in enumerate(ids):
        if name in seen:
            raise OptionError(f"duplicate id {name!r}: ids[{seen[name]}] and ids[{i}]")
        seen[name] = i
        _check_unicode(name, f"id {name!r} (ids[{i}])")
    return ids


def check_output_ids(files: Sequence, read_ids) -> int:
    """Refuse an id held by two rows of an encode output, naming it and both rows by file and row;
    ``read_ids(file)``: the ids of one of ``files``, as lists of strings (a row group's each). Streams:
    8 bytes per id (`dice_fast.id_set.IdSet`), files read again only to name a repeat. Returns the
    number of rows."""
    seen, total = IdSet(), 0
    for f, file in enumerate(files):
        for ids in read_ids(file):
            total += len(ids)
            for name in dict.fromkeys(seen.add(ids)):  # a hash seen before: two rows, or two ids sharing a hash
                rows = [(g, r) for g in range(f + 1)
                        for r, i in enumerate(i for part in read_ids(files[g]) for i in part) if i == name]
                if len(rows) > 1:
                    (g0, r0), (g1, r1) = rows[:2]
                    raise InputError(f"duplicate id {name!r}: {files[g0]} row {r0} and {files[g1]} row {r1}")
    return total


def short_repr(value) -> str:
    """``repr(value)``, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def lookup_ids(ids) -> list[str]:
    """``ids`` (an iterable of ids, never one string: it was read a character at a time) as strings."""
    if isinstance(ids, (str, bytes)):
        raise ArgumentTypeError(f"ids must be a list of ids, not a single {type(ids).__name__} ({short_repr(ids)})")
    return [str(i) for i in ids]


def storable(doc_id: str) -> bool:
    """Whether a store can hold ``doc_id`` (valid Unicode); one it cannot is never held: `contains` answers
    False and `delete` ignores it, in every store alike (two raised a UnicodeEncodeError)."""
    try:
        doc_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_unicode(text: str, name: str) -> None:
    """Refuse a string UTF-8 cannot hold (a lone surrogate, as a JSON escape can make) before it is stored."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{name} is not valid Unicode: {exc.reason} at character {exc.start}") from None


def check_k(k) -> int:
    return checked_integer("k", k)


def evidence_hit(doc_id: str, score: float, query: np.ndarray, chunks: np.ndarray, start, end,
                 text: str | None) -> Hit:
    """The `Hit` of a document scoring ``score``: its best chunk for ``query`` (dim,) among ``chunks``
    (m, dim, unit rows) with spans ``start`` / ``end`` (m,), and that passage of ``text``."""
    if len(chunks) == 0:
        return Hit(doc_id, float(score), -1, 0, 0, float("-inf"), None if text is None else "")
    per_chunk = sc.chunk_scores(query[None, :], chunks)[0]
    j = int(np.argmax(per_chunk))
    s, e = int(start[j]), int(end[j])
    return Hit(doc_id, float(score), j, s, e, float(per_chunk[j]), None if text is None else text[s:e])


def scored_hits(scoring: str, scores) -> list:
    """``scores`` (an iterable of (item, score)) without the items scoring -inf under ``scoring``: a
    document without chunks has no best chunk (maxsim -inf), so ``maxsim`` and ``hybrid`` with
    ``alpha < 1`` never return it (every store alike); ``dice`` ranks it by its document vector."""
    if scoring == "dice":
        return list(scores)
    return [(item, s) for item, s in scores if s != float("-inf")]


class EncoderSlot:
    """The model and options a store's vectors were made with (``model``, ``encoder_options``) and the
    encoder that adds texts and encodes query strings: a passed one must match them; without one,
    the recorded one is rebuilt when first needed. Subclasses set ``dim`` first."""

    def _init_encoder(self, encoder, model: str | None, encoder_options: dict | None, where: str) -> None:
        self.model = recorded_model(model) if model is not None else model_id(encoder) if encoder is not None else None
        if encoder_options is None and encoder is not None:
            encoder_options = vector_options(encoder)
        self.encoder_options = recorded_options(encoder_options)
        self.attach_encoder(encoder, where=where)

    def attach_encoder(self, encoder, *, device: str | None = None, where: str = "this index") -> None:
        """Use ``encoder`` to add texts and encode query strings. It must give ``dim``-wide vectors
        and, when the store records its model and options, match them (ValueError naming each
        difference). None: rebuild the recorded encoder when first needed (on ``device``)."""
        if encoder is not None:
            if encoder.dim != self.dim:
                raise InputError(f"the encoder gives {encoder.dim}-wide vectors, {where} holds {self.dim}")
            if self.model is not None or self.encoder_options:
                check_encoder(encoder, self.model, self.encoder_options, where)
        self.encoder, self._restore_device, self.where = encoder, device, where

    def _need_encoder(self, purpose: str):
        encoder = self.encoder
        if encoder is not None:
            return encoder
        with _RESTORE_LOCK:  # built once, whatever the number of threads asking first
            if self.encoder is None:
                if self.model is None:
                    raise InputError(f"{self.where} has no encoder to {purpose}; pass one (DiceIndex.load(path, "
                                     "encoder), encoder=...) or search with query vectors")
                self.encoder = restore_encoder(self.model, self.encoder_options, self.where, self._restore_device)
            return self.encoder

    def _record_encoder(self) -> None:
        """After a write through the encoder: a store that records no model and options (made for bare
        vectors, ``dim=``) records the encoder's, so a later encoder of another model or options is
        refused as for a store opened with ``encoder=``."""
        if self.model is None and not self.encoder_options and self.encoder is not None:
            self.model, self.encoder_options = model_id(self.encoder), vector_options(self.encoder)
            self._save_record()

    def _save_record(self) -> None:
        """Keep ``model`` and ``encoder_options`` where the store keeps them (`DiceIndex`: its next save)."""

    def _query_vectors(self, queries) -> np.ndarray:
        """(n, dim) float32 query vectors: an array as given (finite: a NaN query got -inf, NaN or an
        error depending on the store), or strings encoded by the encoder."""
        if isinstance(queries, np.ndarray):
            if queries.ndim != 2 or queries.shape[1] != self.dim:
                raise InputError(f"query vectors must be (n, {self.dim}), got {queries.shape}")
            if (bad := sc.first_non_finite(queries)) is not None:
                raise InputError(f"query vector {bad} holds NaN or an infinity")
            return queries.astype(np.float32, copy=False)
        if isinstance(queries, str):
            raise ArgumentTypeError("queries must be a list of strings (or an (n, dim) array), not a single string")
        queries = list(queries)
        if not queries:
            return np.zeros((0, self.dim), np.float32)
        return self._need_encoder("encode query strings").encode_queries(queries)

    def _encoded_windows(self, texts) -> Iterator[tuple[list, object]]:
        """(window of texts, its `DiceOutput` with chunks) in input order, ``texts`` (any iterable of
        strings) read only as far as the encoder's next window (`DiceEncoder.stream_documents`): memory
        is a window, not the input. A list holding a non-string is refused before anything is encoded."""
        if isinstance(texts, (list, tuple)):
            bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
            if bad is not None:
                raise ArgumentTypeError(f"texts[{bad}] is a {type(texts[bad]).__name__}, not a string")
        source = as_iterator(texts, "texts")  # a single string is refused, not read character by character
        encoder = self._need_encoder("add texts")
        read: deque = deque()  # texts the encoder has read and not yet returned: about two windows

        def reading():
            for text in source:
                read.append(text)
                yield text

        for out in encoder.stream_documents(reading(), return_chunks=True):
            yield [read.popleft() for _ in range(len(out.documents))], out
