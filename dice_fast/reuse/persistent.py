"""The persistent chunk cache: chunk vectors in SQLite, shared by processes, bounded and checksummed.

`ChunkCache` keeps ``DIR/chunks.sqlite`` in WAL mode: shared by processes (the ``--shard`` splits of a
job), crash-safe (a killed writer leaves the last committed state), bounded (``max_gb``: least
recently used rows are evicted in batches), every row checksummed (a damaged one is dropped and
recomputed, never returned). `ChunkCache.bind` gives the `CacheNamespace` of one encoder
configuration (`settings_namespace` builds it from an encoder's resolved settings), keyed by `model_fingerprint`
(SHA-256 of the weights and config, remembered per model folder). Rows are found by the chunk keys
and identities of `dice_fast.reuse.keys.chunk_keys`.

Vectors are stored as the pooled chunk vector in float32, before chunk normalisation and aggregation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import dtype_name
from ..errors import ArgumentTypeError, CacheError, OptionError
from ..folder_guard import folder_guard
from .keys import model_fingerprint
from .cache_files import (check_meta, failure_warning, is_cache, private_database, private_folder, sqlite_failure,
                          tighten, unusable)

FORMAT = 1  # bump when what a stored vector means changes
CACHE_FILE = "chunks.sqlite"
_MAGIC = "dice_fast chunk cache"
_LOOKUP = 500  # keys per SELECT ... IN (...)
_BUSY_MS = 60_000  # a writer waits this long for another process's transaction
_EVICT_TO = 0.9  # eviction brings the stored bytes down to this fraction of the bound
_EVICT_BATCH = 4096  # rows looked at per eviction step
_ROW_BYTES = 48  # per-row bytes besides identity and vector (key, namespace, checksum, recency, headers)
RETRY_WRITES_S = 60.0  # after a write failed for want of space or access, writes resume this much later
SERVE_MAX_GB = 10.0  # `dice-fast serve --cache`'s default bound (a server's cache grows with what clients send)


# --------------------------------------------------------------------------------------------
def _folder_signature(path) -> str:
    """Names, sizes and modification times of the files under a model folder (JSON)."""
    root = Path(path)
    items = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if f.startswith("."):
                continue
            st = os.stat(os.path.join(dirpath, f))
            items.append([os.path.relpath(os.path.join(dirpath, f), root), st.st_size, st.st_mtime_ns])
    return json.dumps(items)


class ChunkCache:
    """The persistent chunk cache in ``folder/chunks.sqlite`` (created when missing).

    max_gb: bound on the stored entries (`stored_bytes`; ``None``: unbounded); when a write takes them
    over it, the least recently used rows are deleted in batches down to 90 % of it and freed pages
    are returned to the file system.
    Any number of processes and threads may share one folder. Open with ``ChunkCache(folder)``; a file
    that is not a dice_fast chunk cache raises `CacheError` before anything is written to it. The folder
    is 0700 and its files 0600 whatever the umask (`dice_fast.reuse.cache_files`: they hold every chunk's token
    ids, i.e. the text). If the database turns out damaged while in use, a warning is issued and this
    process continues without it (vectors are computed, never wrong); if it cannot be written (a full
    disk, a read-only or failing file system: ``unwritable``), a warning, reads go on, and writes are tried
    again `RETRY_WRITES_S` later.
    """

    def __init__(self, folder, max_gb: float | None = None):
        if max_gb is not None and (isinstance(max_gb, bool) or not max_gb > 0):
            raise OptionError(f"max_gb must be a number > 0, got {max_gb!r}")
        folder = Path(folder).expanduser()
        private_folder(folder, CACHE_FILE)
        self.folder, self.path = folder, folder / CACHE_FILE
        self.max_bytes = None if max_gb is None else int(max_gb * 1e9)
        self._lock = threading.Lock()
        self.broken: str | None = None  # why this process no longer uses the cache (damaged, or another failure)
        self.unwritable: str | None = None  # why this process does not write to it now (reads go on)
        self._unwritable_at = 0.0  # when: writes are tried again `RETRY_WRITES_S` later (a disk may get room)
        self._touched: dict[int, int] = {}  # rows hit since the last write (key -> ns), for recency
        # one opener at a time, across processes: a database another process is still creating (header
        # written, schema not yet committed) was refused as foreign, or its WAL switch failed as locked
        with folder_guard(folder):
            if private_database(self.path):
                is_cache(self.path, _MAGIC, FORMAT)  # read-only: a foreign file is refused untouched
            tighten(self.path)
            try:
                self._con = sqlite3.connect(self.path, timeout=_BUSY_MS / 1000, isolation_level=None,
                                            check_same_thread=False)
                self._open()
            except sqlite3.DatabaseError as exc:
                raise CacheError(unusable(self.path, exc)) from None

    def _open(self) -> None:
        con = self._con
        con.execute(f"PRAGMA busy_timeout={_BUSY_MS}")
        tables = _tables(con)
        if not tables:
            con.execute("PRAGMA page_size=8192")  # a 384-d row (about 2.6 kB) fills 3 per page, not 1 per 4 kB
            con.execute("PRAGMA auto_vacuum=INCREMENTAL")  # so that eviction can hand pages back
        mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise CacheError(f"{self.path}: cannot use write-ahead logging (journal mode {mode}); "
                             "a chunk cache needs a local file system")
        con.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash keeps every committed transaction but the last
        con.execute("PRAGMA journal_size_limit=67108864")
        if not tables:
            with self._write():
                con.execute("CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value TEXT NOT NULL)")
                con.execute("INSERT OR IGNORE INTO meta VALUES('magic', ?), ('format', ?), ('bytes', '0')",
                            (_MAGIC, str(FORMAT)))
                con.execute("CREATE TABLE IF NOT EXISTS namespaces(id INTEGER PRIMARY KEY, description TEXT "
                            "UNIQUE NOT NULL)")
                con.execute("CREATE TABLE IF NOT EXISTS models(path TEXT NOT NULL, dtype TEXT NOT NULL, files TEXT "
                            "NOT NULL, fingerprint TEXT NOT NULL, PRIMARY KEY(path, dtype))")
                con.execute("CREATE TABLE IF NOT EXISTS chunks(key INTEGER PRIMARY KEY, ns INTEGER NOT NULL, "
                            "ident BLOB NOT NULL, vec BLOB NOT NULL, chk INTEGER NOT NULL, used INTEGER NOT NULL)")
                con.execute("CREATE INDEX IF NOT EXISTS chunks_used ON chunks(used)")
        meta = dict(con.execute("SELECT name, value FROM meta").fetchall()) if not tables or "meta" in tables else {}
        check_meta(self.path, meta, _MAGIC, FORMAT)  # what is_cache read is what this connection opened

    @contextlib.contextmanager
    def _write(self):
        """One write transaction (BEGIN IMMEDIATE: waits up to the busy timeout for other writers)."""
        self._con.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._con.execute("COMMIT")  # a COMMIT that fails (a full disk) is rolled back: no lock stays held
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self._con.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._con.close()

    def __repr__(self) -> str:
        bound = "unbounded" if self.max_bytes is None else f"max {self.max_bytes / 1e9:g} GB"
        return f"ChunkCache({str(self.folder)!r}, {bound})"

    # ----------------------------------------------------------------------------------------
    def bind(self, description: dict, dim: int) -> CacheNamespace:
        """The namespace of one encoder configuration (``description``: JSON-able, compared exactly)."""
        text = json.dumps(description, sort_keys=True)
        row = None
        with self._lock, self._guard("open a namespace"):
            row = self._con.execute("SELECT id FROM namespaces WHERE description=?", (text,)).fetchone()
            if row is None and not self.unwritable:
                with self._write():
                    self._con.execute("INSERT OR IGNORE INTO namespaces(description) VALUES(?)", (text,))
                row = self._con.execute("SELECT id FROM namespaces WHERE description=?", (text,)).fetchone()
        ns = row[0] if row else -1
        return CacheNamespace(self, ns, hashlib.sha256(text.encode()).digest()[:16], dim)

    def fingerprint(self, model, model_path=None) -> str:
        """`model_fingerprint(model)`, remembered per model folder (its files' names, sizes and
        modification times, and the weights' dtype) so that reopening the same model does not reread it."""
        dtype = str(next(model.parameters()).dtype)
        if model_path is None or not Path(model_path).is_dir():
            return model_fingerprint(model)
        path = str(Path(model_path).resolve())
        files = _folder_signature(path)
        row = None
        with self._lock, self._guard("read a model fingerprint"):
            row = self._con.execute("SELECT files, fingerprint FROM models WHERE path=? AND dtype=?",
                                    (path, dtype)).fetchone()
        if row is not None and row[0] == files:
            return row[1]
        fp = model_fingerprint(model)
        if not self.unwritable:
            with self._lock, self._guard("remember a model fingerprint"), self._write():
                self._con.execute("INSERT OR REPLACE INTO models VALUES(?, ?, ?, ?)", (path, dtype, files, fp))
        return fp

    # ----------------------------------------------------------------------------------------
    def get(self, ns: int, keys: list[int], idents: list[bytes], dim: int) -> tuple[dict, int]:
        """Vectors stored for chunks (``keys[i]``, ``idents[i]``) -> ({i: (dim,) float32}, damaged rows).
        A row with another identity (a key collision) is a miss; a damaged row (checksum, length) is
        dropped at the next write."""
        found, damaged = {}, 0
        if self.broken or not keys:
            return found, 0
        where = {}
        for i, k in enumerate(keys):
            where.setdefault(k, []).append(i)
        unique = list(where)
        with self._lock, self._guard("read"):
            rows = []
            for lo in range(0, len(unique), _LOOKUP):
                part = unique[lo:lo + _LOOKUP]
                rows += self._con.execute(f"SELECT key, ns, ident, vec, chk FROM chunks WHERE key IN "
                                          f"({','.join('?' * len(part))})", part).fetchall()
            for key, row_ns, ident, vec, chk in rows:
                if row_ns != ns or ident != idents[where[key][0]]:
                    continue
                if not isinstance(vec, bytes) or len(vec) != 4 * dim or _checksum(key, ns, ident, vec) != chk:
                    damaged += 1
                    self._touched[key] = None  # None: delete
                    continue
                v = np.frombuffer(vec, "<f4")
                for i in where[key]:
                    found[i] = v
                self._touched[key] = ns
            if self.unwritable:
                self._touched.clear()  # nothing is written: no recency to keep
            elif len(self._touched) >= 4096:  # a long run of hits: record their recency now and then
                with self._guard("write"):
                    self._commit([])
        return found, damaged

    def put(self, ns: int, keys: list[int], idents: list[bytes], vectors: np.ndarray) -> int:
        """Store float32 ``vectors`` (n, dim) for chunks (keys, idents) in one transaction, refresh the
        recency of rows read since the last write, drop damaged rows, and evict to the bound. Returns rows written."""
        if self.unwritable and time.monotonic() - self._unwritable_at > RETRY_WRITES_S:
            self.unwritable = None  # try again: a failure warns again, at most once per RETRY_WRITES_S
        if self.broken or self.unwritable:
            return 0
        vectors = np.ascontiguousarray(vectors, "<f4")
        rows = [(k, ns, ident, v.tobytes()) for k, ident, v in zip(keys, idents, vectors)]
        with self._lock, self._guard("write"):
            self._commit(rows)
            return len(rows)
        return 0

    def flush(self) -> None:
        """Write the recency of rows read (and drop damaged rows found) since the last write."""
        if self._touched and not self.broken and not self.unwritable:
            with self._lock, self._guard("write"):
                self._commit([])

    def _commit(self, rows: list) -> None:
        now = time.time_ns() // 1000
        touched, self._touched = self._touched, {}
        con = self._con
        with self._write():
            freed = self._delete([k for k, v in touched.items() if v is None])
            keep = [k for k, v in touched.items() if v is not None]
            if keep:
                con.executemany("UPDATE chunks SET used=? WHERE key=?", [(now, k) for k in keep])
            there = set()
            for lo in range(0, len(rows), _LOOKUP):
                part = [r[0] for r in rows[lo:lo + _LOOKUP]]
                there.update(r[0] for r in con.execute(
                    f"SELECT key FROM chunks WHERE key IN ({','.join('?' * len(part))})", part))
            con.executemany("INSERT OR REPLACE INTO chunks VALUES(?, ?, ?, ?, ?, ?)",
                            [(k, n, i, b, _checksum(k, n, i, b), now) for k, n, i, b in rows])
            added = sum(_ROW_BYTES + len(i) + len(b) for k, _, i, b in rows if k not in there)
            self._account(added - freed)
            if self.max_bytes is not None and rows:
                self._evict()
        if self.max_bytes is not None and rows:
            con.execute("PRAGMA incremental_vacuum").fetchall()  # hand the pages freed by eviction back

    def stored_bytes(self) -> int:
        """Bytes of the stored entries (identity + vector + a fixed 48 per row): what ``max_gb`` bounds.
        The file is larger by SQLite's page slack (about 10 %)."""
        with self._lock:
            return int(self._con.execute("SELECT value FROM meta WHERE name='bytes'").fetchone()[0])

    def _account(self, delta: int) -> None:
        if delta:
            self._con.execute("UPDATE meta SET value=CAST(value AS INTEGER)+? WHERE name='bytes'", (delta,))

    def _delete(self, keys: list[int]) -> int:
        """Delete rows (inside a write transaction); returns their bytes (as `stored_bytes` counts them)."""
        freed = 0
        for lo in range(0, len(keys), _LOOKUP):
            part = keys[lo:lo + _LOOKUP]
            marks = ",".join("?" * len(part))
            freed += self._con.execute(f"SELECT coalesce(sum({_ROW_BYTES} + length(ident) + length(vec)), 0) FROM "
                                       f"chunks WHERE key IN ({marks})", part).fetchone()[0]
            self._con.execute(f"DELETE FROM chunks WHERE key IN ({marks})", part)
        return int(freed)

    def _evict(self) -> None:
        """Delete the least recently used rows in batches until the entries take at most ``_EVICT_TO`` of
        the bound (inside the write transaction)."""
        con = self._con
        stored = int(con.execute("SELECT value FROM meta WHERE name='bytes'").fetchone()[0])
        if stored <= self.max_bytes:
            return
        target = int(self.max_bytes * _EVICT_TO)
        while stored > target:
            oldest = con.execute(f"SELECT key, {_ROW_BYTES} + length(ident) + length(vec) FROM chunks "
                                 "ORDER BY used LIMIT ?", (_EVICT_BATCH,)).fetchall()
            if not oldest:
                break
            keys, total = [], 0
            for k, size in oldest:
                if stored - total <= target:
                    break
                keys.append(k)
                total += size
            self._account(-self._delete(keys))
            stored -= total

    @contextlib.contextmanager
    def _guard(self, what: str):
        """Turn an SQLite error into a warning (`dice_fast.reuse.cache_files.sqlite_failure` tells which): a
        lock held elsewhere skips this write; a file that cannot be written (full disk, read-only, I/O
        error) stops this process's writes, reads go on; a damaged file (or any other error) stops its use."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            kind = sqlite_failure(exc)
            if kind == "busy" or (self.unwritable if kind == "unwritable" else self.broken) is None:  # once
                warnings.warn(failure_warning(self.path, kind, what, exc), RuntimeWarning, stacklevel=4)
            if kind == "unwritable":
                self.unwritable, self._unwritable_at = self.unwritable or str(exc), time.monotonic()
            elif kind != "busy":
                self.broken = self.broken or str(exc)


@dataclass(frozen=True)
class CacheNamespace:
    """A `ChunkCache` seen by one encoder configuration: ``salt`` keys its chunks (see `dice_fast.reuse.keys.chunk_keys`)."""

    cache: ChunkCache
    id: int
    salt: bytes
    dim: int

    def get(self, keys: list[int], idents: list[bytes]) -> tuple[dict, int]:
        return self.cache.get(self.id, keys, idents, self.dim)

    def put(self, keys: list[int], idents: list[bytes], vectors: np.ndarray) -> int:
        return self.cache.put(self.id, keys, idents, vectors)

    def flush(self) -> None:
        self.cache.flush()


def _checksum(key: int, ns: int, ident: bytes, vec: bytes) -> int:
    """CRC-32 of a row's key, namespace, identity and vector (a row moved, cut or altered fails it)."""
    return zlib.crc32(vec, zlib.crc32(ident, zlib.crc32(f"{key}:{ns}".encode())))


def _tables(con) -> set:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def open_cache(cache, max_gb: float | None = None) -> ChunkCache:
    """``cache`` as a `ChunkCache`: a folder path (opened) or a `ChunkCache` (returned)."""
    if isinstance(cache, ChunkCache):
        if max_gb is not None:
            raise ArgumentTypeError("max_gb belongs to the ChunkCache passed in; set it there")
        return cache
    if not isinstance(cache, (str, os.PathLike)):
        raise ArgumentTypeError(f"cache must be a folder path or a ChunkCache, got {type(cache).__name__}")
    return ChunkCache(cache, max_gb)


def settings_namespace(settings, model, cache, max_gb=None, model_path=None, precision=None) -> CacheNamespace:
    """The `CacheNamespace`, in ``cache`` (a folder or a `ChunkCache`), of an encoder's resolved
    `dice_fast.settings.Settings` for ``model``: everything a chunk's vector depends on besides its ids
    (the wrapped ids and positions are in each identity)."""
    from ..runinfo import minor_versions

    store = open_cache(cache, max_gb)
    description = {
        "format": FORMAT,
        "model": store.fingerprint(model, model_path),
        "dtype": precision or dtype_name(settings.dtype),
        "device": settings.device.type,
        "pooling": settings.pooling,
        "causal": settings.is_causal,
        "first_position": settings.spec.first_position,
        **minor_versions(),  # torch, transformers
        **({"head": settings.head.digest} if settings.head is not None else {}),  # the head modules' weights
    }
    return store.bind(description, settings.chunk_dim)  # chunk vectors are full width (truncate_dim: after)


__all__ = ["ChunkCache", "CacheNamespace", "CacheError", "settings_namespace", "model_fingerprint", "open_cache",
           "CACHE_FILE"]
