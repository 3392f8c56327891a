"""`QdrantStore`: DICE vectors in a Qdrant collection (``pip install dice-fast[qdrant]``).

One point per document: id ``uuid5(NAMESPACE, document id)`` (Qdrant ids are integers or UUIDs; a
fixed mapping makes every write idempotent), two named vectors, ``doc`` (dense, dot product) and
``chunks`` (a multivector of unit chunk vectors compared by ``MAX_SIM``, HNSW off, ``m=0``, as Qdrant
recommends for multivectors), and the payload ``{"id", "start", "end", "tokens", "text"?}``. A
document without chunks has no ``chunks`` vector (``maxsim`` never returns it). The collection's
metadata holds the store's record (dim, model, options), checked when it is opened again; a
collection without one (made by something else) is refused.

The same client API runs in process (``QdrantClient(path=DIR)`` or ``":memory:"``: exact, MaxSim in a
Python loop, for parity and prototypes; it warns above 20,000 points) and against a server or cluster
(``QdrantClient(url=...)``: the ``doc`` vector by HNSW, MaxSim exact over the multivectors).
Qdrant does not say which chunk won MaxSim: hits take the argmax over the returned chunk vectors.
In process, the client's calls take turns (`OneCallAtATime`): its on-disk persistence runs sqlite
transactions from whichever thread calls, and two threads writing at once failed with sqlite3 errors.
"""

from __future__ import annotations

import threading
import uuid
from typing import Sequence

import numpy as np

from .common import lookup_ids, storable
from ..errors import require
from .remote import DEFAULT_BATCH, Candidate, RemoteStore

NAMESPACE = uuid.UUID("6f1e3c2a-5d4b-4e8f-9a7c-0d1e2f3a4b5c")  # document id -> point id


def point_id(doc_id: str) -> str:
    return str(uuid.uuid5(NAMESPACE, str(doc_id)))


class OneCallAtATime:
    """A client whose method calls take turns, one thread at a time; attributes are the client's."""

    def __init__(self, client):
        self._inner, self._lock = client, threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)

        return call


def _in_process(client) -> bool:
    """Whether ``client`` runs Qdrant in this process (``path=`` or ``":memory:"``), not against a server."""
    return type(getattr(client, "_client", None)).__name__ == "QdrantLocal"


class QdrantStore(RemoteStore):
    """Documents of one Qdrant collection (see the module docstring).

    client: a ``qdrant_client.QdrantClient`` (local path, ":memory:" or a server URL); collection: its
    name, created when missing (then ``dim`` or ``encoder`` is needed; ``create=False`` refuses a
    missing one). encoder / model / encoder_options: the encoder that made the vectors (recorded; a
    reopened collection refuses other ones); store_text: keep texts in the payload (default: as
    recorded, else True); batch_size: points per upsert, at most (and about `write_bytes` bytes).
    """

    kind = "qdrant"

    def __init__(self, client, collection: str, *, dim: int | None = None, encoder=None, model: str | None = None,
                 encoder_options: dict | None = None, store_text: bool | None = None, batch_size: int = DEFAULT_BATCH,
                 create: bool = True):
        self._models = require("qdrant_client.models", extra="qdrant", needed_by="the Qdrant store")
        if _in_process(client):
            client = OneCallAtATime(client)
        self.client, self.collection = client, str(collection)
        where = f"Qdrant collection {self.collection!r}"
        exists = client.collection_exists(self.collection)
        record = None
        if exists:  # {}: a collection without a dice_fast record (refused)
            record = (client.get_collection(self.collection).config.metadata or {}).get("dice_fast") or {}
        dim = self._width(dim, encoder, record, where, create)
        self._setup(dim, encoder, model, encoder_options, store_text, record, batch_size, where)
        if not exists:
            self._create()

    def _create(self) -> None:
        m = self._models
        vectors = {
            "doc": m.VectorParams(size=self.dim, distance=m.Distance.DOT),
            "chunks": m.VectorParams(size=self.dim, distance=m.Distance.DOT,
                                     multivector_config=m.MultiVectorConfig(comparator=m.MultiVectorComparator.MAX_SIM),
                                     hnsw_config=m.HnswConfigDiff(m=0)),
        }
        self.client.create_collection(self.collection, vectors_config=vectors, metadata={"dice_fast": self.record()})

    def _save_record(self) -> None:
        self.client.update_collection(self.collection, metadata={"dice_fast": self.record()})

    def _write_failures(self) -> tuple[type[BaseException], ...]:
        import sqlite3  # the in-process client's storage ("database or disk is full")

        from qdrant_client.http.exceptions import ApiException  # a server's refusal

        return (OSError, sqlite3.Error, ApiException)

    def _write(self, b) -> None:
        points = []
        for d, doc_id in enumerate(b.ids):
            c0, c1 = int(b.cu[d]), int(b.cu[d + 1])
            vector = {"doc": b.documents[d].tolist()}
            if c1 > c0:
                vector["chunks"] = b.chunks[c0:c1].tolist()
            payload = {"id": doc_id, "start": b.start[c0:c1].tolist(), "end": b.end[c0:c1].tolist(),
                       "tokens": b.tokens[c0:c1].tolist()}
            if b.texts is not None:
                payload["text"] = b.texts[d]
            points.append(self._models.PointStruct(id=point_id(doc_id), vector=vector, payload=payload))
        self.client.upsert(self.collection, points=points, wait=True)

    def _nearest(self, queries: np.ndarray, scoring: str, limit: int) -> list[list[Candidate]]:
        request = self._models.QueryRequest
        using = "doc" if scoring == "dice" else "chunks"
        requests = [request(query=q.tolist() if scoring == "dice" else [q.tolist()], using=using, limit=limit,
                            with_payload=True, with_vector=True) for q in queries]
        out = []
        for response in self.client.query_batch_points(self.collection, requests=requests):
            out.append([self._candidate(p) for p in response.points])
        return out

    def _candidate(self, point) -> Candidate:
        vectors, payload = point.vector or {}, point.payload or {}
        chunks = np.asarray(vectors.get("chunks") or np.zeros((0, self.dim)), np.float32).reshape(-1, self.dim)
        return Candidate(payload["id"], np.asarray(vectors["doc"], np.float32), chunks, payload["start"],
                         payload["end"], payload.get("text"))

    def delete(self, ids: Sequence) -> int:
        """Remove the documents ``ids`` (ids not stored are ignored); returns how many it found and removed
        (looked up, then removed: an id another writer adds in between stays)."""
        held = self._stored(ids)
        for i in range(0, len(held), 1024):  # as `contains`: a request of bounded size
            points = [point_id(x) for x in held[i : i + 1024]]
            self.client.delete(self.collection, points_selector=self._models.PointIdsList(points=points), wait=True)
        return len(held)

    def contains(self, ids: Sequence) -> list[bool]:
        """For each id in ``ids``: whether the collection holds it."""
        ids = lookup_ids(ids)
        found = set()
        for i in range(0, len(ids), 1024):
            asked = [point_id(x) for x in ids[i : i + 1024] if storable(x)]
            records = self.client.retrieve(self.collection, ids=asked, with_payload=["id"], with_vectors=False)
            found.update(r.payload["id"] for r in records)
        return [i in found for i in ids]

    def fetch(self, ids: Sequence) -> dict:
        """{id: `Candidate`} of the documents of ``ids`` the collection holds (ids not stored are left out)."""
        found = {}
        ids = [i for i in lookup_ids(ids) if storable(i)]
        for i in range(0, len(ids), 256):
            for point in self.client.retrieve(self.collection, ids=[point_id(x) for x in ids[i : i + 256]],
                                              with_payload=True, with_vectors=True):
                record = self._candidate(point)
                found[record.id] = record
        return found

    def __len__(self) -> int:
        return int(self.client.count(self.collection, exact=True).count)
