"""The chunk cache's files are private (folder 0700, database, -wal and -shm 0600, whatever the umask),
a file that is not a chunk cache is refused before anything touches it, and ``dice-fast serve --cache``
is bounded unless told otherwise."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat

import numpy as np
import pytest

from dice_fast.reuse.persistent import CACHE_FILE, SERVE_MAX_GB, CacheError, ChunkCache
from dice_fast.cli import build_parser
from dice_fast.cliargs import cache_options


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _write_some(cache: ChunkCache) -> None:
    space = cache.bind({"test": 1}, 8)
    space.put([1, 2, 3], [b"one", b"two", b"three"], np.ones((3, 8), np.float32))


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_the_folder_and_every_file_are_private_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        folder = tmp_path / "new" / "cache"
        cache = ChunkCache(folder)
        _write_some(cache)  # the connection stays open: -wal and -shm exist now
        files = sorted(p.name for p in folder.iterdir())
        assert files == [CACHE_FILE, f"{CACHE_FILE}-shm", f"{CACHE_FILE}-wal"], files
        assert _mode(folder) == 0o700 and _mode(folder.parent) == 0o700  # parents made here too (0777 before)
        assert {name: _mode(folder / name) for name in files} == dict.fromkeys(files, 0o600)
        cache.close()
    finally:
        os.umask(old)


def test_a_cache_left_readable_by_an_older_version_is_tightened(tmp_path):
    folder = tmp_path / "c"
    cache = ChunkCache(folder)
    _write_some(cache)
    for p in (folder, *folder.iterdir()):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    again = ChunkCache(folder)
    assert _mode(folder) == 0o700 and all(_mode(p) == 0o600 for p in folder.iterdir())
    assert len(again.bind({"test": 1}, 8).get([1, 2, 3], [b"one", b"two", b"three"])[0]) == 3
    cache.close(), again.close()


def _snapshot(folder):
    """Every file in ``folder`` with its mode and a hash of its bytes."""
    return {p.name: (_mode(p), hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("kind", ["rollback journal", "write-ahead log", "write-ahead log, a view only",
                                  "write-ahead log, other tables", "not sqlite", "damaged header"])
def test_a_foreign_or_damaged_file_is_refused_untouched(tmp_path, kind):
    """Refused from its header or a read-only look at its schema: no byte, mode or side file changes
    (before, a foreign database was switched to WAL mode before being refused)."""
    folder = tmp_path / "c"
    folder.mkdir()
    path = folder / CACHE_FILE
    if kind.startswith(("rollback journal", "write-ahead log")):
        con = sqlite3.connect(path)
        if kind.startswith("write-ahead log"):
            con.execute("PRAGMA journal_mode=WAL")
        if kind.endswith("other tables"):  # not an empty database (which a cut-off creation leaves): refused
            con.execute("CREATE TABLE users(name TEXT)")
        elif kind.endswith("a view only"):
            con.execute("CREATE VIEW v AS SELECT 1")
        else:
            con.execute("CREATE TABLE meta(name TEXT, value TEXT)")  # even a table of the cache's name
            con.execute("INSERT INTO meta VALUES('magic', 'someone else')")
        con.commit()
        con.close()
    elif kind == "not sqlite":
        path.write_bytes(b"not a database at all " * 200)
    else:
        ChunkCache(folder).close()
        data = bytearray(path.read_bytes())
        data[:16] = b"SQLite format 2\x00"
        path.write_bytes(bytes(data))
    os.chmod(path, 0o640)
    before = _snapshot(folder)
    with pytest.raises(CacheError, match="not a dice_fast chunk cache|not a usable dice_fast chunk cache"):
        ChunkCache(folder)
    assert _snapshot(folder) == before


def test_a_symbolic_link_in_the_database_s_place_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere.sqlite"
    ChunkCache(tmp_path / "real").close()
    os.replace(tmp_path / "real" / CACHE_FILE, elsewhere)
    (tmp_path / "real" / CACHE_FILE).symlink_to(elsewhere)
    with pytest.raises(CacheError, match="symbolic link"):
        ChunkCache(tmp_path / "real")


@pytest.mark.parametrize("argv,max_gb", [
    (["serve", "--cache", "D"], SERVE_MAX_GB),
    (["serve", "--cache", "D", "--cache-max-gb", "2.5"], 2.5),
    (["serve", "--cache", "D", "--cache-max-gb", "unbounded"], None),
    (["encode", "in.jsonl", "-o", "out", "--cache", "D"], None),  # a job's cache grows with its own corpus
])
def test_serve_bounds_its_cache_by_default(argv, max_gb):
    assert cache_options(build_parser().parse_args(argv)) == {"cache": "D", "cache_max_gb": max_gb}
    assert cache_options(build_parser().parse_args(argv[:1] + ["in.jsonl", "-o", "out"] * (argv[0] == "encode"))) == {}


def test_bad_bounds_are_refused_by_name(capsys):
    for value in ("0", "-1", "inf", "lots"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--cache", "D", "--cache-max-gb", value])
        assert "--cache-max-gb" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--cache-max-gb needs --cache DIR"):
        cache_options(build_parser().parse_args(["serve", "--cache-max-gb", "3"]))
