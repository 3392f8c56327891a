"""An exclusive lock on a job's output, so that two live jobs never write the same files (a scheduler
retrying a split while the first attempt still runs, two shells, ...).

Each job holds ``fcntl.flock`` on a hidden lock file in the output's folder for as long as it runs:

* a shard folder: ``DIR/.dice-fast.lock`` for an unsplit job, ``DIR/.dice-fast-IofN.lock`` for split
  ``I/N``; splits ``0/N`` ... ``N-1/N`` of one count coexist, everything else in one folder conflicts
  (an unsplit job and a split, or splits of different counts, would both write parts and manifests
  that the other's reader takes for its own);
* a single file ``OUT.npy`` / ``OUT.parquet``: ``.OUT.npy.dice-fast.lock`` beside it.

The kernel releases a flock when its process dies, ``kill -9`` included, so a lock is never stale: a
lock file left behind is just reused. Its content (one JSON line: pid, host, start time, command)
only names the holder for the refusal message. Taking and releasing locks happens under a second,
short flock on the folder itself, which makes "look at the other jobs' locks, then take mine" one
step and lets a job delete its lock file on the way out without racing a newcomer that opened it.
Lock files are opened without following symbolic links (a link, a FIFO or anything but a regular file
in a lock file's place is refused, naming it), and one owned by another user (left by a dead job) is
locked as it is, never truncated or rewritten.

Needs a file system with working ``flock`` (local disks; on NFS, flock is emulated and may refuse).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shlex
import socket
import stat
import sys
from pathlib import Path

from ..errors import DiceError, WriteError, writing
from ..folder_guard import folder_guard
from ..side_files import side_stem

_SPLIT_LOCK = re.compile(r"^\.dice-fast(?:-(\d+)of(\d+))?\.lock$")


class OutputLocked(DiceError, ValueError):
    """Another live job holds the output (a ValueError: the command reports it in one line, exit 2)."""


def folder_lock_name(index: int, count: int) -> str:
    """The lock file of split ``index/count`` of a shard folder (``count == 1``: an unsplit job)."""
    return ".dice-fast.lock" if count == 1 else f".dice-fast-{index}of{count}.lock"


def file_lock_name(output: Path) -> str:
    """The lock file beside a single-file output ``OUT.npy`` / ``OUT.parquet``."""
    return f".{side_stem(output.name, len('..dice-fast.lock'))}.dice-fast.lock"


def _splits_conflict(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[1] == 1 or b[1] == 1 or a[1] != b[1] or a[0] == b[0]


class OutputLock:
    """``with OutputLock(folder, name, rivals):`` holds ``folder/name`` exclusively; raises `OutputLocked`
    naming the holder when that file, or one of ``rivals(folder)`` (other lock files in the folder
    whose holders this job must not run beside), is held by a live process.

    Use `for_folder` / `for_file` to build one; ``release`` is idempotent.
    """

    def __init__(self, output: Path, folder: Path, name: str, rivals=lambda folder: ()):
        self.output, self.folder, self.path, self.rivals = Path(output), Path(folder), Path(folder) / name, rivals
        self.fd: int | None = None

    @classmethod
    def for_folder(cls, folder: Path, index: int = 0, count: int = 1) -> "OutputLock":
        def rivals(f: Path):
            for p in f.iterdir():
                m = _SPLIT_LOCK.match(p.name)
                if m and p.name != folder_lock_name(index, count):
                    other = (int(m.group(1)), int(m.group(2))) if m.group(1) else (0, 1)
                    if _splits_conflict((index, count), other):
                        yield p

        return cls(folder, folder, folder_lock_name(index, count), rivals)

    @classmethod
    def for_file(cls, output: Path) -> "OutputLock":
        return cls(output, output.parent, file_lock_name(output))

    # -----------------------------------------------------------------------------------------
    def acquire(self) -> "OutputLock":
        with folder_guard(self.folder):
            for rival in self.rivals(self.folder):
                holder = _holder_if_live(rival)
                if holder is not None:
                    raise OutputLocked(self._refusal(rival, holder))
                with contextlib.suppress(OSError):
                    rival.unlink()  # left by a dead job; nobody can be taking it while we hold the guard
            fd = _open_lock(self.path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ValueError(f"cannot lock {self.path}: {exc.strerror} (the output needs a file system "
                                     "with flock)") from None
                raise OutputLocked(self._refusal(self.path, holder)) from None
            if os.fstat(fd).st_uid == os.getuid():  # another user's file (left by a dead job) is locked, not rewritten
                try:
                    with writing(self.path):  # a full disk: named, and no lock file left behind
                        os.ftruncate(fd, 0)
                        os.write(fd, (json.dumps(_me()) + "\n").encode("utf-8"))
                except WriteError:
                    os.close(fd)
                    self.path.unlink(missing_ok=True)
                    raise
            self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        with folder_guard(self.folder, missing_ok=True):
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self.fd)  # closing releases the flock
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()

    def _refusal(self, path: Path, holder: dict) -> str:
        m = _SPLIT_LOCK.match(path.name)
        job = "job" if not m else "unsplit job" if not m.group(1) else f"job of split {m.group(1)}/{m.group(2)}"
        return (f"{self.output} is locked by a running dice-fast encode {job} ({describe(holder)}); wait for it "
                f"to end or stop it (the lock dies with its process)")


def describe(holder: dict) -> str:
    """``{"pid": 12, ...}`` -> ``pid 12 on host h since 2026-12-01T08:50:00Z: dice-fast encode ...``."""
    if not holder:
        return "holder unknown"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('started', '?')}: "
            f"{holder.get('command', '?')}")


def _me() -> dict:
    command = " ".join(shlex.quote(a) for a in sys.argv)
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command if len(command) <= 300 else command[:297] + "..."}


def _open_lock(path: Path, flags: int) -> int:
    """A descriptor of lock file ``path``, opened without following a symbolic link (nor blocking on a
    FIFO); ValueError naming the path if it is a link or not a regular file (created 0644 if missing)."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link, not a dice-fast lock file; remove it") from None
        if exc.errno in (errno.EACCES, errno.EPERM) and flags & os.O_RDWR and os.path.lexists(path):  # another user's: flock needs no write
            return _open_lock(path, os.O_RDONLY)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file, not a dice-fast lock file; remove it")
    return fd


def _read_holder(fd: int) -> dict:
    """The holder recorded in the lock file open as ``fd`` ({} if none can be read)."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _holder_if_live(path: Path) -> dict | None:
    """The holder of lock file ``path`` if a live process holds it, else None."""
    try:
        fd = _open_lock(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return _read_holder(fd)
    finally:
        os.close(fd)
    return None


def is_held(path: Path) -> bool:
    """Whether a live process holds lock file ``path`` (for tests and diagnostics)."""
    return _holder_if_live(Path(path)) is not None
