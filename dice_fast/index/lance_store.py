"""`LanceStore`: DICE vectors in a LanceDB table (``pip install dice-fast[lancedb]``).

One row per document: ``id`` (string), ``doc`` (``fixed_size_list<float32, dim>``, searched by dot
product), ``chunks`` (``list<fixed_size_list<float32, dim>>`` of unit chunk vectors, searched by
MaxSim with the dot product, so a zero row scores 0 as in `DiceIndex`; once `build_index` indexes
them, with the cosine metric, the only one LanceDB indexes multivectors by: equal on unit rows, but a
zero row's cosine is NaN and hides its document from that search), ``start`` / ``end`` /
``tokens`` (``list<int64>``) and ``text`` (nullable string). Writes are ``merge_insert`` on ``id``
(re-adding a document replaces it). The schema's metadata holds the store's record (dim, model,
options), checked when the table is opened again; a record written later (the first encoder of a
table made with ``dim=``) is in the ``id`` field's metadata. A table without a record (made by
something else) is refused.

Ids are found through a BTree index on ``id`` (made with the table, or at the first write to a table
made before), so a write's ``merge_insert`` and `contains` / `fetch` / `delete` do not scan the table;
rows written since the index was last brought up to date are scanned, so every `OPTIMIZE_EVERY` writes
the store runs ``table.optimize()`` (compacts the writes' small fragments, indexes the new rows; old
versions are kept, as LanceDB's default). Without them a write cost time in proportion to the table:
pushing N documents cost O(N^2) (18 -> 137 ms per 512-document write from 8.7k to 132k rows; 11-15 ms
with both: RESULTS §38.2).

Embedded, on local disk or object storage (the URI LanceDB takes); searches are exact (flat) until
`build_index` puts an IVF-PQ index over ``chunks`` or ``doc``; then ``search_options`` (``nprobes``,
``refine_factor``) trade recall for time (docs/retrieval.md has recall@10 against exact).
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from .common import lookup_ids, storable
from ..errors import OptionError, require
from .remote import DEFAULT_BATCH, Candidate, RemoteStore

OPTIMIZE_EVERY = 16  # writes (and deletes) between two ``table.optimize()`` of one store


class LanceStore(RemoteStore):
    """Documents of one LanceDB table (see the module docstring).

    uri: a LanceDB database (a folder, or an object-store URI) or a connection; table: its name,
    created when missing (then ``dim`` or ``encoder`` is needed); encoder / model / encoder_options /
    store_text / batch_size as `QdrantStore`; search_options: ``nprobes`` and ``refine_factor`` for
    an indexed column.
    """

    kind = "lancedb"
    write_bytes = 64 << 20  # Arrow batches: no request limit, only memory and the number of table versions
    float_bytes = 4

    def __init__(self, uri, table: str, *, dim: int | None = None, encoder=None, model: str | None = None,
                 encoder_options: dict | None = None, store_text: bool | None = None,
                 batch_size: int = DEFAULT_BATCH, search_options: dict | None = None, create: bool = True):
        lancedb = require("lancedb", "pyarrow", extra="lancedb", needed_by="the LanceDB store")  # both imported
        import pyarrow

        self._pa = pyarrow
        self.db = lancedb.connect(str(uri)) if isinstance(uri, (str, bytes)) or hasattr(uri, "__fspath__") else uri
        self.name = str(table)
        where = f"LanceDB table {self.name!r}"
        try:
            self.table = self.db.open_table(self.name)
        except ValueError:
            self.table = None
        record = None if self.table is None else _stored_record(self.table.schema)
        dim = self._width(dim, encoder, record, where, create)
        self.search_options = dict(search_options or {})
        self._setup(dim, encoder, model, encoder_options, store_text, record, batch_size, where)
        self._writes = 0
        if self.table is None:
            self.table = self.db.create_table(self.name, schema=self._schema())
            self._index_ids()

    def _schema(self):
        pa = self._pa
        vector = pa.list_(pa.float32(), self.dim)
        return pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("doc", vector),
                          pa.field("chunks", pa.list_(vector)), pa.field("start", pa.list_(pa.int64())),
                          pa.field("end", pa.list_(pa.int64())), pa.field("tokens", pa.list_(pa.int64())),
                          pa.field("text", pa.string())],
                         metadata={b"dice_fast": json.dumps(self.record()).encode()})

    def _write_failures(self) -> tuple[type[BaseException], ...]:
        return (OSError, RuntimeError)  # lance: "RuntimeError: lance error: LanceError(IO): No space left ..."

    def _write(self, b) -> None:
        pa = self._pa
        vector = pa.list_(pa.float32(), self.dim)
        offsets = pa.array(b.cu.astype(np.int32))
        flat_chunks = pa.FixedSizeListArray.from_arrays(pa.array(b.chunks.reshape(-1)), self.dim)
        columns = {
            "id": pa.array(b.ids, pa.string()),
            "doc": pa.FixedSizeListArray.from_arrays(pa.array(b.documents.reshape(-1)), self.dim),
            "chunks": pa.ListArray.from_arrays(offsets, flat_chunks, type=pa.list_(vector)),
            "start": pa.ListArray.from_arrays(offsets, pa.array(b.start)),
            "end": pa.ListArray.from_arrays(offsets, pa.array(b.end)),
            "tokens": pa.ListArray.from_arrays(offsets, pa.array(b.tokens)),
            "text": pa.array(b.texts if b.texts is not None else [None] * len(b.ids), pa.string()),
        }
        data = pa.table(columns, schema=self.table.schema)
        self.table.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(data)
        self._wrote()

    def _index_ids(self) -> None:
        """The BTree index on ``id`` (module docstring). Best effort: a table another writer is changing at
        the same moment may refuse it, and a later write tries again."""
        from lancedb.index import BTree

        try:
            _create_index(self.table, "id", BTree(), replace=False,
                          legacy=lambda: self.table.create_scalar_index("id", index_type="BTREE", replace=False))
        except (OSError, RuntimeError, ValueError):
            pass

    def _wrote(self) -> None:
        """After a write or delete (the first, then every `OPTIMIZE_EVERY`): index a table that has no id
        index, else bring the index and the fragments up to date (best effort, as `_index_ids`)."""
        self._writes += 1
        if self._writes > 1 and self._writes % OPTIMIZE_EVERY:
            return
        if not any(list(getattr(i, "columns", ())) == ["id"] for i in self.table.list_indices()):
            self._index_ids()
        elif self._writes > 1:
            try:
                self.table.optimize()
            except (OSError, RuntimeError, ValueError):
                pass

    def _save_record(self) -> None:
        raw = json.dumps(self.record())  # the schema's metadata cannot be changed: the id field's can
        if hasattr(self.table, "update_field_metadata"):  # lancedb >= 0.33.1
            self.table.update_field_metadata({"path": "id", "metadata": {"dice_fast": raw}})
        else:
            self.table.replace_field_metadata("id", {"dice_fast": raw})

    def _nearest(self, queries: np.ndarray, scoring: str, limit: int) -> list[list[Candidate]]:
        out = []
        # the dot product scores a zero chunk row 0 (cosine: NaN, its document lost); an index over the
        # chunks is cosine (LanceDB indexes multivectors by no other metric) and is used only by cosine
        indexed = any("chunks" in getattr(i, "columns", ()) for i in self.table.list_indices())
        chunk_metric = "cosine" if indexed else "dot"
        for q in queries:
            if scoring == "dice":
                query = self.table.search(q, vector_column_name="doc").metric("dot")
            else:
                query = self.table.search(q[None, :], vector_column_name="chunks").metric(chunk_metric)
            if "nprobes" in self.search_options:
                query = query.nprobes(int(self.search_options["nprobes"]))
            if "refine_factor" in self.search_options:
                query = query.refine_factor(int(self.search_options["refine_factor"]))
            rows = query.limit(limit).to_arrow()
            out.append(self._candidates(rows))
        return out

    def _candidates(self, rows) -> list[Candidate]:
        ids, texts = rows["id"].to_pylist(), rows["text"].to_pylist()
        docs = np.asarray(rows["doc"].combine_chunks().flatten(), np.float32).reshape(-1, self.dim)
        chunks = rows["chunks"].combine_chunks()
        offsets = np.asarray(chunks.offsets, np.int64)
        flat = np.asarray(chunks.flatten().flatten(), np.float32).reshape(-1, self.dim)
        starts, ends = rows["start"].to_pylist(), rows["end"].to_pylist()
        return [Candidate(ids[i], docs[i], flat[offsets[i] - offsets[0] : offsets[i + 1] - offsets[0]], starts[i],
                          ends[i], texts[i]) for i in range(len(ids))]

    def build_index(self, column: str = "chunks", *, num_partitions: int | None = None,
                    num_sub_vectors: int | None = None) -> None:
        """Put an IVF-PQ index over ``column`` ("chunks": MaxSim, cosine, the only metric LanceDB indexes
        multivectors by; "doc": dot product); searches of that column become approximate
        (``search_options`` tune them)."""
        if column not in ("chunks", "doc"):
            raise OptionError(f"column must be 'chunks' or 'doc', got {column!r}")
        from lancedb.index import IvfPq

        options = {k: v for k, v in (("num_partitions", num_partitions), ("num_sub_vectors", num_sub_vectors))
                   if v is not None}
        metric = "cosine" if column == "chunks" else "dot"
        _create_index(self.table, column, IvfPq(distance_type=metric, **options), replace=True,
                      legacy=lambda: self.table.create_index(metric=metric, vector_column_name=column,
                                                             index_type="IVF_PQ", replace=True, **options))

    def delete(self, ids: Sequence) -> int:
        """Remove the documents ``ids`` (ids not stored are ignored); returns how many it found and removed
        (looked up, then removed: an id another writer adds in between stays)."""
        held = self._stored(ids)
        for i in range(0, len(held), 512):
            self.table.delete(_in_list(held[i : i + 512]))
            self._wrote()
        return len(held)

    def contains(self, ids: Sequence) -> list[bool]:
        """For each id in ``ids``: whether the table holds it."""
        ids = lookup_ids(ids)
        found = set()
        asked = [i for i in ids if storable(i)]
        for i in range(0, len(asked), 512):
            part = asked[i : i + 512]
            rows = self.table.search().where(_in_list(part)).select(["id"]).limit(len(part)).to_arrow()
            found.update(rows["id"].to_pylist())
        return [i in found for i in ids]

    def fetch(self, ids: Sequence) -> dict:
        """{id: `Candidate`} of the documents of ``ids`` the table holds (ids not stored are left out)."""
        found = {}
        ids = [i for i in lookup_ids(ids) if storable(i)]
        for i in range(0, len(ids), 512):
            part = ids[i : i + 512]
            for record in self._candidates(self.table.search().where(_in_list(part)).limit(len(part)).to_arrow()):
                found[record.id] = record
        return found

    def __len__(self) -> int:
        return int(self.table.count_rows())


def _stored_record(schema) -> dict:
    """The record a table holds ({} when none): the ``id`` field's (written after creation) or the schema's."""
    metadata = dict(schema.metadata or {})
    if "id" in schema.names:
        metadata.update(schema.field("id").metadata or {})
    raw = metadata.get(b"dice_fast")
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def _create_index(table, column: str, config, replace: bool, legacy) -> None:
    """``table.create_index(column, config=config)``: lancedb >= 0.34; its older sync tables take no
    ``config`` (TypeError), and there ``legacy()`` makes the same index the way lancedb now deprecates."""
    try:
        table.create_index(column, config=config, replace=replace)
    except TypeError:
        legacy()


def _in_list(ids: Sequence) -> str:
    """An SQL ``id IN (...)`` filter with every id quoted ('' for a quote)."""
    quoted = ", ".join("'" + str(i).replace("'", "''") + "'" for i in ids)
    return f"id IN ({quoted})"
