"""The chunk cache under faults that can really happen: the file damaged under an open connection (one
warning, right vectors), another connection holding the write lock (a warning per refused write, right
vectors, writes resume once it lets go), a process killed inside the real commit (the database keeps
its last committed state and its stored byte count still equals its rows) or while creating a new cache
(the next opener makes it), and a full disk (one warning, reads go on, nothing called damaged)."""

from __future__ import annotations

import os
import sqlite3
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import dice_fast.reuse.persistent as cc
from dice_fast import DiceEncoder
from dice_fast.reuse.persistent import CACHE_FILE, ChunkCache
from helpers import assert_close, kill_at_gate
from oracle import ATOL, K, text_of
from tiny_models import tiny

ROOT = Path(__file__).resolve().parents[1]


def _encoder(cache):
    m, tok, *_ = tiny("bert")
    return DiceEncoder(m, tok, cache=cache, chunk_size=K, max_batch_tokens=200, pooling_impl="torch")


@pytest.fixture(scope="module")
def texts():
    rng = __import__("random").Random(11)
    return [text_of(rng.randint(2 * K, 6 * K), rng) for _ in range(16)]


@pytest.fixture(scope="module")
def want(texts):
    m, tok, *_ = tiny("bert")
    return DiceEncoder(m, tok, chunk_size=K, pooling_impl="torch").encode_documents(texts, return_chunks=True)


def _damage_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "is damaged" in str(w.message)]


def test_damage_under_an_open_connection_gives_one_warning_and_right_vectors(tmp_path, texts, want):
    enc = _encoder(tmp_path / "c")
    enc.encode_documents(texts)  # the cache is written; its connection stays open
    path = tmp_path / "c" / CACHE_FILE
    with sqlite3.connect(path) as other:  # everything into the main file, where the damage will be
        assert other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    page = 8192
    with open(path, "r+b") as f:  # every page but the first (the header and schema) overwritten
        size = os.fstat(f.fileno()).st_size
        rng = np.random.default_rng(0)
        for at in range(page, size, page):
            f.seek(at)
            f.write(rng.integers(0, 256, page, dtype=np.uint8).tobytes())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = enc.encode_documents(texts, return_chunks=True)
        second = enc.encode_documents(texts[::-1], return_chunks=True)  # the cache is no longer used: no warning
    assert len(_damage_warnings(caught)) == 1, [str(w.message) for w in caught]
    assert enc.cache.cache.broken is not None
    assert_close(first.documents, want.documents, ATOL, what="documents after damage")
    assert_close(first.chunks, want.chunks, ATOL, what="chunks after damage")
    assert_close(second.documents, want.documents[::-1], ATOL, what="documents, second call")


def test_a_write_refused_by_another_connection_s_lock_warns_and_writes_resume(tmp_path, texts, want, monkeypatch):
    monkeypatch.setattr(cc, "_BUSY_MS", 300)  # wait 0.3 s for the lock instead of a minute
    enc = _encoder(tmp_path / "c")
    half = len(texts) // 2
    holder = sqlite3.connect(tmp_path / "c" / CACHE_FILE, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another connection holds the write lock
    holder.execute("UPDATE meta SET value=value WHERE name='bytes'")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = enc.encode_documents(texts[:half], return_chunks=True)
    refused = [w for w in caught if "could not write" in str(w.message) and "locked" in str(w.message)]
    assert refused and not _damage_warnings(caught), [str(w.message) for w in caught]
    assert enc.cache.cache.broken is None  # busy is not damage: the cache stays in use
    assert_close(got.documents, want.documents[:half], ATOL, what="documents while locked")
    assert enc.chunk_stats.written == 0
    holder.execute("ROLLBACK")
    holder.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = enc.encode_documents(texts, return_chunks=True)
    assert enc.chunk_stats.written > 0
    assert_close(again.chunks, want.chunks, ATOL, what="chunks once the lock is gone")
    reader = _encoder(tmp_path / "c")
    reader.encode_documents(texts)
    assert reader.chunk_stats.computed == 0  # everything written after the lock went away


_KILLED_IN_COMMIT = r"""
import sqlite3, sys, threading
from pathlib import Path
import numpy as np
from dice_fast.reuse.persistent import ChunkCache
gate, folder, at, where = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
real_connect = sqlite3.connect
begun = [0]

def hook(sql):  # inside the real ChunkCache._commit: its transaction's own statements
    if sql == "BEGIN IMMEDIATE":
        begun[0] += 1
    statement = {"commit": "COMMIT", "eviction": "DELETE FROM chunks", "schema": "CREATE TABLE"}[where]
    if begun[0] == at and sql.startswith(statement):
        gate.write_text(where)
        threading.Event().wait()  # killed here

def connect(*args, **kwargs):
    con = real_connect(*args, **kwargs)
    con.set_trace_callback(hook)
    return con

sqlite3.connect = connect
cache = ChunkCache(folder, max_gb=60 * (48 + 64 + 4 * 64) / 1e9)  # room for about 60 rows: later writes evict
space = cache.bind({"test": 1}, 64)
rng = np.random.default_rng(0)
for batch in range(20):
    keys = [batch * 1000 + i for i in range(25)]
    space.put(keys, [k.to_bytes(8, "little") * 8 for k in keys], rng.standard_normal((25, 64)).astype(np.float32))
    print(batch, flush=True)
raise SystemExit("never killed")
"""


def _consistent(path: Path) -> tuple[int, set]:
    """(rows, keys) of a cache file after checking its integrity and that its byte count equals its rows."""
    with sqlite3.connect(path) as con:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        stored = int(con.execute("SELECT value FROM meta WHERE name='bytes'").fetchone()[0])
        counted = con.execute(f"SELECT coalesce(sum({cc._ROW_BYTES} + length(ident) + length(vec)), 0) FROM "
                              "chunks").fetchone()[0]
        keys = {r[0] for r in con.execute("SELECT key FROM chunks")}
    assert stored == counted, (stored, counted)
    return len(keys), keys


@pytest.mark.parametrize("where", ["commit", "eviction"])
def test_a_process_killed_inside_the_real_commit_leaves_counts_that_match_the_rows(tmp_path, where):
    """SIGKILL lands inside ChunkCache._commit's transaction, at its COMMIT statement or in the middle of
    its eviction; the file keeps the last committed state, and its byte count equals its rows."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_IN_COMMIT)
    gate, folder = tmp_path / "gate", tmp_path / "c"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    at = 6  # transactions: the schema, the namespace, then puts: the 4th put (past the bound, it evicts)
    out = kill_at_gate([sys.executable, str(script), str(gate), str(folder), str(at), where], gate, env, "the hook")
    committed = len(out.split())  # puts that returned before the kill
    assert committed == at - 3, out
    rows, keys = _consistent(folder / CACHE_FILE)
    assert not any(k // 1000 == committed for k in keys)  # the killed put left nothing
    assert any(k // 1000 == committed - 1 for k in keys) and rows <= 60
    cache = ChunkCache(folder, max_gb=60 * (48 + 64 + 4 * 64) / 1e9)  # reopened: still usable, still consistent
    space = cache.bind({"test": 1}, 64)
    keys = list(range(90_000, 90_025))
    space.put(keys, [k.to_bytes(8, "little") * 8 for k in keys], np.ones((25, 64), np.float32))
    cache.close()
    assert _consistent(folder / CACHE_FILE)[1] >= set(keys)


@pytest.mark.parametrize("where", ["schema", "commit"])
def test_a_process_killed_while_creating_a_new_cache_leaves_one_the_next_opener_makes(tmp_path, where):
    """Killed after the WAL switch wrote the header and before the schema committed (at its first CREATE
    TABLE, or at its COMMIT): the file is an SQLite database with no tables, which the next opener
    takes as new, not as a foreign file to delete."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_IN_COMMIT)
    gate, folder = tmp_path / "gate", tmp_path / "c"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    assert kill_at_gate([sys.executable, str(script), str(gate), str(folder), "1", where], gate, env, "the hook") == ""
    with sqlite3.connect(f"{(folder / CACHE_FILE).as_uri()}?mode=ro", uri=True) as con:
        assert con.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0  # what the kill left
    cache = ChunkCache(folder)
    space = cache.bind({"test": 1}, 4)
    assert space.put([1, 2], [b"a", b"b"], np.ones((2, 4), np.float32)) == 2 and len(space.get([1, 2], [b"a", b"b"])[0]) == 2
    assert cache._con.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL, as a cache made in one go
    cache.close()


def test_a_full_disk_warns_once_and_reads_go_on(tmp_path, monkeypatch):
    """SQLITE_FULL (a full disk; a read-only or failing file system alike) is not damage: one warning
    saying new chunks are not stored, rows already stored are still served, and no lock stays held."""
    cache = ChunkCache(tmp_path / "c")
    space = cache.bind({"test": 1}, 4)
    space.put([1], [b"a"], np.ones((1, 4), np.float32))
    pages = cache._con.execute("PRAGMA page_count").fetchone()[0]
    cache._con.execute(f"PRAGMA max_page_count={pages}")  # the next write that needs a page fails as a full disk does
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert space.put(list(range(2, 400)), [bytes(600)] * 398, np.ones((398, 4), np.float32)) == 0
        assert space.put([500], [b"z"], np.ones((1, 4), np.float32)) == 0  # not tried again: no second warning
        got, damaged = space.get([1, 2], [b"a", bytes(600)])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "could not write (database or disk is full); continuing without storing new chunks" \
        in messages[0] and "damaged" not in messages[0] and "Delete" not in messages[0], messages
    assert cache.broken is None and cache.unwritable == "database or disk is full"
    assert list(got) == [0] and damaged == 0
    with sqlite3.connect(tmp_path / "c" / CACHE_FILE, isolation_level=None, timeout=0) as other:
        other.execute("BEGIN IMMEDIATE")  # the failed transaction was rolled back: its write lock is free
        other.execute("ROLLBACK")
    # once the disk has room again, writes resume RETRY_WRITES_S later (a long-running server is not left
    # without writes until it restarts)
    cache._con.execute("PRAGMA max_page_count=1073741823")
    monkeypatch.setattr(cc, "RETRY_WRITES_S", 0.0)
    assert space.put([500], [b"z"], np.ones((1, 4), np.float32)) == 1
    assert cache.unwritable is None and list(space.get([500], [b"z"])[0]) == [0]
    cache.close()


def test_sqlite_errors_are_told_apart_by_code_and_by_message(tmp_path):
    from dice_fast.reuse.cache_files import sqlite_failure, unusable

    path = tmp_path / "d.sqlite"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE t(x)")
    ro = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError) as readonly:
        ro.execute("INSERT INTO t VALUES(1)")
    ro.close()
    (tmp_path / "junk.sqlite").write_bytes(b"junk" * 1024)
    with pytest.raises(sqlite3.DatabaseError) as notadb:
        sqlite3.connect(tmp_path / "junk.sqlite").execute("SELECT * FROM sqlite_master")
    assert sqlite_failure(readonly.value) == "unwritable" and sqlite_failure(notadb.value) == "damaged"
    assert unusable(path, readonly.value).startswith(f"cannot open the chunk cache {path} (attempt to write a readonly")
    assert "delete it" not in unusable(path, readonly.value) and "delete it" in unusable(path, notadb.value)
    for message, kind in [("database or disk is full", "unwritable"), ("attempt to write a readonly database", "unwritable"),
                          ("disk I/O error", "unwritable"), ("unable to open database file", "unwritable"),
                          ("database is locked", "busy"), ("database disk image is malformed", "damaged"),
                          ("file is not a database", "damaged"), ("no such table: chunks", "failed")]:
        assert sqlite_failure(sqlite3.OperationalError(message)) == kind, message  # no error code: by message
