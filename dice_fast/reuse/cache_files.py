"""The chunk cache's files: private, and never written before they are known to be a chunk cache.

The cache stores every chunk's token ids, which decode back to the text that was encoded (a server's
clients' text), so:

* `private_folder`: the cache folder is created 0700 whatever the umask; an existing folder is tightened
  to 0700 when this user owns it, it is not sticky (as ``/tmp`` is) and it already holds a cache file.
* `private_database`: the database file is created 0600 whatever the umask, opened without following a
  symbolic link (a link, or anything but a regular file, is refused). SQLite creates its ``-wal`` and
  ``-shm`` files (the only other files; WAL mode keeps its locks in ``-shm``) with the database
  file's mode, so they are 0600 too; `tighten` makes existing ones of this user's (from older
  versions) 0600 once `is_cache` has accepted the file.
* `is_cache`: reads an existing file before anything writes to it: the 100-byte SQLite header (a
  file that is not SQLite, or an SQLite database not in WAL mode, as every chunk cache is, is refused
  from the header alone), then the schema and the ``meta`` table without locking or creating any file
  (SQLite's ``immutable`` open), and only if the answer may sit in an existing ``-wal`` file through
  an ordinary read-only connection; with no ``-wal`` file it reads once more the immutable way (a
  writer's last connection may have checkpointed the log into the main file and deleted it between
  the first read and the look for the log: the file was then refused as foreign). A WAL database with
  no tables at all is a new cache whose creator was killed after the WAL switch wrote the header and
  before the schema committed: it is accepted, and the opener (holding the folder guard) makes it.
* `sqlite_failure`: what an SQLite error means for the cache: a lock held by another connection, a
  file that cannot be written (full disk, read-only, I/O error, permissions: the file is fine), or a
  damaged file.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from pathlib import Path

from ..errors import CacheError

_HEADER = b"SQLite format 3\x00"
SIDE_FILES = ("-wal", "-shm")


def private_folder(folder: Path, cache_file: str) -> None:
    """Create ``folder`` and its missing parents 0700 (the parents were made 0777 less the umask: under
    umask 000 anyone could swap the cache folder for their own), or tighten it (see module)."""
    if folder.exists() and not folder.is_dir():
        raise CacheError(f"--cache {folder} is a file; give a folder (the cache is {cache_file} inside it)")
    if not folder.exists():
        for parent in reversed([p for p in folder.absolute().parents if not p.exists()]):
            with contextlib.suppress(FileExistsError):
                os.mkdir(parent, 0o700)
                os.chmod(parent, 0o700)
        with contextlib.suppress(FileExistsError):  # another process made it first: tightened below
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)  # mkdir's mode is masked by the umask; this is not
            return
    st = os.stat(folder)
    if (st.st_uid == os.getuid() and not st.st_mode & stat.S_ISVTX and st.st_mode & 0o077
            and (folder / cache_file).exists()):
        os.chmod(folder, 0o700)


def private_database(path: Path) -> bool:
    """Create ``path`` 0600 if missing; refuse a symbolic link or a file that is not regular. Returns
    whether the file holds anything yet (then check it with `is_cache` before `tighten`)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        link = " (a symbolic link: the cache file must be a regular file)" if os.path.islink(path) else ""
        raise CacheError(f"cannot open {path}: {exc.strerror}{link}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{path} is not a regular file; delete it or choose another --cache folder")
        if st.st_size == 0 and st.st_uid == os.getuid():
            os.fchmod(fd, 0o600)  # open's mode is masked by the umask; this is not
        return st.st_size > 0
    finally:
        os.close(fd)


def tighten(path: Path) -> None:
    """Make ``path`` and its ``-wal`` / ``-shm`` 0600 where this user owns them (a cache of an older version)."""
    for side in (path, *(Path(f"{path}{suffix}") for suffix in SIDE_FILES)):
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(side)
            if not stat.S_ISREG(st.st_mode):
                raise CacheError(f"{side} is not a regular file; delete it")
            if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o600:
                os.chmod(side, 0o600)


def is_cache(path: Path, magic: str, fmt: int) -> bool:
    """Refuse (`CacheError`) an existing, non-empty ``path`` that is not a chunk cache of ``magic`` and
    format ``fmt``, reading only (see module). Returns False for a WAL database with no tables at all
    (a creation cut off before its schema committed: a new cache, made by the caller), True for a cache."""
    with open(path, "rb") as f:
        head = f.read(100)
    if len(head) < 100 or not head.startswith(_HEADER):
        raise CacheError(unusable(path, "not an SQLite database"))
    if head[18:20] != b"\x02\x02":  # not in WAL mode
        check_meta(path, {}, magic, fmt)
    uri = path.resolve().as_uri()
    meta = None
    with contextlib.suppress(sqlite3.DatabaseError):  # e.g. a page being checkpointed meanwhile: read again below
        meta = _meta(f"{uri}?mode=ro&immutable=1")
    if meta is None or meta.get("magic") != magic:
        if Path(f"{path}-wal").exists():
            meta = _meta(f"{uri}?mode=ro", path)  # what the main file lacks may be in the write-ahead log
        else:  # no log (any more): a writer's last close may have checkpointed it into the main file since the
            meta = _meta(f"{uri}?mode=ro&immutable=1", path)  # first read, then deleted it; the file is whole now
    if meta is _NO_TABLES:
        return False
    check_meta(path, meta, magic, fmt)
    return True


def check_meta(path: Path, meta: dict, magic: str, fmt: int) -> None:
    """`CacheError` unless ``meta`` (a database's meta table) is that of a chunk cache of format ``fmt``."""
    if meta.get("magic") != magic:
        raise CacheError(f"{path} is an SQLite file but not a dice_fast chunk cache; delete it or choose another "
                         "--cache folder")
    if meta.get("format") != str(fmt):
        raise CacheError(f"{path} is a chunk cache of format {meta.get('format')}, this dice_fast reads format "
                         f"{fmt}; delete it or choose another --cache folder")


def unusable(path: Path, why) -> str:
    """The message of a `CacheError` for a cache file at ``path`` that cannot be used because of ``why``
    (an SQLite error that says the file cannot be written or reached gets no advice to delete it)."""
    kind = sqlite_failure(why) if isinstance(why, sqlite3.Error) else None
    if kind == "unwritable":
        return f"cannot open the chunk cache {path} ({why}); check the free space and permissions of {path.parent}"
    if kind == "busy":
        return f"cannot open the chunk cache {path} ({why}): another process holds it locked; try again"
    return f"{path} is not a usable dice_fast chunk cache ({why}); delete it or choose another --cache folder"


def sqlite_failure(exc: sqlite3.Error) -> str:
    """What ``exc`` says about a cache file: "busy" (another connection holds a lock past the busy timeout),
    "unwritable" (no space, read-only, an I/O error, no permission: the file itself is fine),
    "damaged" (SQLITE_CORRUPT, SQLITE_NOTADB) or "failed" (anything else). By SQLite's primary error
    code (Python 3.11+), else by its message."""
    name = getattr(exc, "sqlite_errorname", None)
    if name:
        primary = "_".join(name.split("_")[:2])  # SQLITE_IOERR_SHORT_READ -> SQLITE_IOERR
    else:
        text = str(exc).lower()
        primary = next((code for code, words in _MESSAGES.items() if words in text), "")
    for kind, codes in _KINDS.items():
        if primary in codes:
            return kind
    return "failed"


def failure_warning(path: Path, kind: str, what: str, exc) -> str:
    """The warning for an SQLite error ``exc`` of `sqlite_failure` ``kind`` while trying to ``what``."""
    if kind == "busy":
        return f"dice_fast: chunk cache {path}: could not {what} ({exc}); continuing"
    if kind == "unwritable":
        return f"dice_fast: chunk cache {path}: could not {what} ({exc}); continuing without storing new chunks"
    state, advice = ("is damaged", " Delete the file to start a new cache.") if kind == "damaged" else ("failed", "")
    return (f"dice_fast: chunk cache {path} {state} ({exc} while trying to {what}); this process continues "
            f"without it, computing every chunk.{advice}")


# SQLite's primary error codes by what they mean for the cache, and their messages (older Pythons)
_KINDS = {"busy": ("SQLITE_BUSY", "SQLITE_LOCKED"), "damaged": ("SQLITE_CORRUPT", "SQLITE_NOTADB"),
          "unwritable": ("SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_PERM")}
_MESSAGES = {"SQLITE_BUSY": "database is locked", "SQLITE_LOCKED": "table is locked", "SQLITE_FULL": "is full",
             "SQLITE_READONLY": "readonly database", "SQLITE_IOERR": "disk i/o error",
             "SQLITE_CANTOPEN": "unable to open database file", "SQLITE_PERM": "access permission denied",
             "SQLITE_CORRUPT": "malformed", "SQLITE_NOTADB": "not a database"}
_NO_TABLES: dict = {}  # what `_meta` returns for a database with no tables at all (compared by identity)


def _meta(uri: str, path: Path | None = None) -> dict:
    """The ``meta`` table of the database at ``uri`` ({} if it has none, `_NO_TABLES` if it has no tables at
    all); sqlite3.DatabaseError, or `CacheError` naming ``path`` when given."""
    try:
        con = sqlite3.connect(uri, uri=True, timeout=10)
        try:
            schema = con.execute("SELECT type, name FROM sqlite_master").fetchall()
            if not schema:
                return _NO_TABLES
            tables = {name for kind, name in schema if kind == "table"}
            return dict(con.execute("SELECT name, value FROM meta").fetchall()) if "meta" in tables else {}
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        if path is None:
            raise
        raise CacheError(unusable(path, exc)) from None
