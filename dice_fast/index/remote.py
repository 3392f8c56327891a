"""`RemoteStore`: what the Qdrant and LanceDB stores share above their client calls.

A store keeps one record per document: its id, its document vector, its chunk vectors (unit rows)
with their spans and token counts, and its text when ``store_text``. A subclass provides these calls:
``_write(batch)`` (replace-or-insert the records of a checked `Batch` slice), ``_nearest(queries,
scoring, limit)`` (per query the records the database ranks first by ``dice`` or ``maxsim``, as
`Candidate`s), ``delete(ids)``, ``contains(ids)``, ``fetch(ids)`` (the stored records, as `Candidate`s),
``_save_record()`` (keep `record` in the database) and ``__len__``.

Writes go in requests of at most ``batch_size`` documents and about ``write_bytes`` bytes each (a
document's vectors counted at ``float_bytes`` a number, its spans and text beside them): a long
document's hundreds of chunk vectors make one request as big as many short documents. A single
document above the budget goes alone.

Search scores the candidates again here in float32 from their returned vectors, exactly as
`DiceIndex` does (so scores, order and evidence agree with `DiceIndex` on the same vectors whenever
the database's own ranking is exact). ``hybrid`` with ``0 < alpha < 1`` takes the union of the top
``candidates`` by ``dice`` and by ``maxsim`` and ranks it by the blend: every returned score is
exact, and a document is missed only when it is outside both lists (docs/retrieval.md measures it).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from .. import scoring as sc
from ..config import checked_integer
from ..errors import InputError, WriteError, one_line
from ..streaming import as_iterator
from .common import (DEFAULT_SCORING, Batch, EncoderSlot, Hit, check_batch, check_ids, check_k, evidence_hit,
                     lookup_ids, scored_hits, short_repr)
from .encoder_match import model_id, recorded_model, vector_options

DEFAULT_BATCH = 256  # documents per write, at most
_MOST = 2**31 - 1  # records one search asks a database for


class Candidate(NamedTuple):
    """A record as returned by a search: id, document (dim,), chunks (m, dim), start, end (m,), text."""

    id: str
    document: np.ndarray
    chunks: np.ndarray
    start: Sequence[int]
    end: Sequence[int]
    text: str | None


class RemoteStore(EncoderSlot):
    """Base of `QdrantStore` and `LanceStore` (see the module docstring)."""

    kind = "store"
    write_bytes = 8 << 20  # bytes per write request, about (a Qdrant server refuses requests above 32 MB)
    float_bytes = 24  # bytes a vector component takes in a request (JSON: "-0.012345678901234567,")

    def close(self) -> None:
        """Release the database client (a local Qdrant's file lock and threads); the store is not used after."""
        close = getattr(getattr(self, "client", None), "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _width(self, dim: int | None, encoder, record, where: str, create: bool) -> int:
        """The vectors' width, from ``dim``, the encoder or ``record`` (what the existing collection /
        table holds, None when it does not exist). Refuses one that exists without a dice_fast record,
        and, unless ``create``, one that does not exist."""
        if record is not None and (not isinstance(record, dict) or record.get("format") != f"dice_fast.{self.kind}/1"):
            raise InputError(f"{where} exists but was not written by dice_fast (no dice_fast record); "
                             "choose another name")
        if record is None and not create:
            raise InputError(f"{where} does not exist")
        if dim is None:
            dim = encoder.dim if encoder is not None else (record or {}).get("dim")
        if dim is None:
            raise InputError(f"{where} does not exist: give dim= or encoder= to create it")
        return dim

    def _setup(self, dim: int, encoder, model, encoder_options, store_text: bool | None, record: dict | None,
               batch_size: int, where: str) -> None:
        """Common construction: ``record`` is what an existing collection / table holds (None: new);
        ``store_text`` None means as recorded, else True."""
        batch_size = checked_integer("batch_size", batch_size)
        if store_text is None:
            store_text = bool(record.get("store_text", True)) if isinstance(record, dict) else True
        self.dim, self.store_text, self.batch_size = int(dim), bool(store_text), batch_size
        explicit = model is not None or bool(encoder_options)
        self._init_encoder(None, model, encoder_options, where)
        if record is not None:
            self._check_record(record, where, explicit)
        elif encoder is not None and not explicit:
            self.model, self.encoder_options = model_id(encoder), vector_options(encoder)
        self.attach_encoder(encoder, where=where)

    def record(self) -> dict:
        """What the store records about its vectors (kept in the database beside them)."""
        return {"format": f"dice_fast.{self.kind}/1", "dim": self.dim, "model": self.model,
                "encoder_options": self.encoder_options, "store_text": self.store_text}

    def _check_record(self, found: dict, where: str, explicit: bool) -> None:
        """Refuse a collection / table whose record differs from this store's width and texts, and
        (``explicit``: opened with a model and options) its model and options; adopt the recorded
        model and options otherwise (a passed encoder is then checked against them). ``found`` is a
        dice_fast record (`_width` refused anything else)."""
        mine = self.record()
        keys = ("dim", "store_text", "model") if explicit else ("dim", "store_text")
        for key in keys:
            if found.get(key) != mine[key]:
                raise InputError(f"{where} holds vectors with {key} {short_repr(found.get(key))}, not "
                                 f"{short_repr(mine[key])}; choose another name or delete it")
        theirs = dict(found.get("encoder_options") or {})
        if explicit and theirs != mine["encoder_options"]:
            names = sorted(k for k in set(theirs) | set(mine["encoder_options"])
                           if theirs.get(k) != mine["encoder_options"].get(k))
            raise InputError(f"{where} holds vectors made with other options ({', '.join(names)}: "
                             f"{short_repr({k: theirs.get(k) for k in names})}); choose another name or delete it")
        self.model, self.encoder_options = recorded_model(found.get("model")), theirs

    # ---------------------------------------------------------------------------------------------
    def add(self, texts, ids: Sequence) -> None:
        """Encode ``texts`` (n strings) and write them under ``ids`` (n distinct, checked before anything
        is encoded), replacing documents with the same ids, a window of the encoder at a time (memory:
        one window's vectors; a failure midway leaves the windows written, which a repeated add
        rewrites). A store that records no model (made with ``dim=``) records the encoder's model and
        options at its first write."""
        texts = list(as_iterator(texts, "texts"))  # a single string is refused, not split into characters
        ids = check_ids(ids, len(texts))
        done = 0
        for window, out in self._encoded_windows(texts):
            self.upsert_arrays(ids[done : done + len(window)], out.documents, out.chunks, out.chunk_document,
                               out.chunk_start_char, out.chunk_end_char, out.chunk_end - out.chunk_start,
                               window if self.store_text else None)
            done += len(window)
            self._record_encoder()

    def upsert_arrays(self, ids: Sequence, documents, chunks, chunk_document, chunk_start_char, chunk_end_char,
                      chunk_tokens, texts: Sequence[str] | None = None) -> None:
        """Write encoded documents (shapes as `DiceIndex.add_arrays`) in requests of at most ``batch_size``
        documents and about ``write_bytes`` bytes; a document whose id is already stored is replaced, so a
        write can be repeated."""
        b = check_batch(self.dim, ids, documents, chunks, chunk_document, chunk_start_char, chunk_end_char,
                        chunk_tokens, texts, self.store_text)
        for d0, d1 in self._write_ranges(b):
            try:
                self._write(_slice(b, d0, d1))
            except self._write_failures() as exc:  # a full disk, a server refusing: one line, not a traceback
                raise WriteError(f"cannot write to {self.where}: {one_line(exc)[:300]}") from exc

    def _stored(self, ids: Sequence) -> list[str]:
        """The distinct ids of ``ids`` the store holds, in their order (what a `delete` removes and counts)."""
        ids = list(dict.fromkeys(lookup_ids(ids)))
        return [i for i, held in zip(ids, self.contains(ids)) if held]

    def _write_failures(self) -> tuple[type[BaseException], ...]:
        """What the store's client raises when its database cannot take a write (each store adds its own)."""
        return (OSError,)

    def _write_ranges(self, b: Batch) -> list[tuple[int, int]]:
        """Document ranges [d0, d1) of ``b``, one a request: at most ``batch_size`` documents, and about
        ``write_bytes`` bytes unless a single document is bigger."""
        counts = np.diff(b.cu)
        size = (counts + 1) * self.dim * self.float_bytes + counts * 3 * 12 + 256  # vectors, spans, the rest
        if b.texts is not None:
            size = size + np.array([len(t.encode("utf-8")) for t in b.texts], np.int64)
        ranges, d0, total = [], 0, 0
        for d, bytes_ in enumerate(size.tolist()):
            if d > d0 and (d - d0 >= self.batch_size or total + bytes_ > self.write_bytes):
                ranges.append((d0, d))
                d0, total = d, 0
            total += bytes_
        if d0 < len(b.ids):
            ranges.append((d0, len(b.ids)))
        return ranges

    add_arrays = upsert_arrays

    def holds(self, ids: Sequence, documents, chunks, chunk_document, chunk_start_char, chunk_end_char,
              chunk_tokens) -> bool:
        """Whether the store holds exactly these documents (shapes as `upsert_arrays`): every id, with the
        document vector, chunk vectors and spans `upsert_arrays` would write. What a resumed push skips: a
        shard whose ids are stored but whose vectors or spans changed (a re-encoded edit) is written again."""
        b = check_batch(self.dim, ids, documents, chunks, chunk_document, chunk_start_char, chunk_end_char,
                        chunk_tokens, None, False)
        stored = self.fetch(b.ids)
        if len(stored) != len(b.ids):
            return False
        for d, name in enumerate(b.ids):
            have, (c0, c1) = stored[name], (int(b.cu[d]), int(b.cu[d + 1]))
            if not (np.array_equal(have.document, b.documents[d]) and np.array_equal(have.chunks, b.chunks[c0:c1])
                    and list(have.start) == b.start[c0:c1].tolist() and list(have.end) == b.end[c0:c1].tolist()):
                return False
        return True

    # ---------------------------------------------------------------------------------------------
    def search(self, queries, k: int = 10, scoring: str = DEFAULT_SCORING, *, alpha: float = sc.DEFAULT_ALPHA,
               candidates: int | None = None) -> list[list[Hit]]:
        """Rank documents for ``queries`` (n strings or an (n, dim) array): n lists of at most ``k``
        `Hit`s, best first, as `DiceIndex.search`. ``candidates``: documents fetched per scoring and
        re-scored here from their vectors (default ``k``, and ``max(4 k, 40)`` for the hybrid blend;
        never fewer than ``k``); more raise the recall of an approximate (indexed) search. Equal scores
        come in the database's order (`DiceIndex`: insertion order)."""
        sc.check_scoring(scoring)
        alpha = sc.check_alpha(alpha)
        k = check_k(k)
        q = self._query_vectors(queries)
        if len(q) == 0:
            return []
        def nearest(by: str, limit: int):  # a database takes at most 2**31-1 records at once (LanceDB: OverflowError)
            return self._nearest(q, by, min(limit, _MOST))

        if scoring == "hybrid" and alpha in (0.0, 1.0):
            lists = nearest("maxsim" if alpha == 0.0 else "dice", max(k, check_k(candidates or k)))
        elif scoring == "hybrid":
            limit = max(k, check_k(candidates)) if candidates is not None else max(4 * k, 40)
            by_dice, by_maxsim = nearest("dice", limit), nearest("maxsim", limit)
            lists = [list({c.id: c for c in a + b}.values()) for a, b in zip(by_dice, by_maxsim)]
        else:
            lists = nearest(scoring, max(k, check_k(candidates or k)))
        return [self._rank(qv, found, k, scoring, alpha) for qv, found in zip(q, lists)]

    def _rank(self, qv: np.ndarray, found: list[Candidate], k: int, scoring: str, alpha: float) -> list[Hit]:
        scored = []
        for position, c in enumerate(found):
            dice = float(sc.dice(qv[None, :], c.document[None, :])[0][0, 0])
            best = float(sc.chunk_scores(qv[None, :], c.chunks)[0].max()) if len(c.chunks) else float("-inf")
            s = {"dice": dice, "maxsim": best}.get(scoring)
            if s is None:
                s = float(sc.blend(alpha, np.float32(dice), np.float32(best)))
            if math.isnan(s):  # a product past float32's range: last, as DiceIndex ranks it (it sorted NaN anywhere)
                s = float("-inf")
            scored.append((-s, position, c))
        scored.sort(key=lambda t: (t[0], t[1]))
        kept = scored_hits(scoring, ((c, -s) for s, _, c in scored))
        return [evidence_hit(c.id, s, qv, c.chunks, c.start, c.end, c.text) for c, s in kept[:k]]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where}, {len(self)} documents, dim={self.dim})"


def _slice(b: Batch, d0: int, d1: int) -> Batch:
    c0, c1 = int(b.cu[d0]), int(b.cu[d1])
    return Batch(b.ids[d0:d1], b.documents[d0:d1], b.chunks[c0:c1], b.cu[d0 : d1 + 1] - c0, b.start[c0:c1],
                 b.end[c0:c1], b.tokens[c0:c1], None if b.texts is None else b.texts[d0:d1])
