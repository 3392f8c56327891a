"""A short exclusive ``flock`` on a folder itself, so that a few file-system steps in it are one step
across processes and threads (flock locks belong to an open file description: two opens in one
process exclude each other too). Used where "look, then create" must not interleave: a corpus job
taking its output lock (`dice_fast.corpus.lock`), a process creating the chunk cache's database
(`dice_fast.reuse.persistent`); and held longer, a process compiling the C++ extension
(`dice_fast.ops.native`) or writing an OpenVINO cache entry (`dice_fast.quant.model_cache`). Blocking,
and otherwise held only for a few system calls; needs a file system with working ``flock`` (local
disks). Where the platform has no ``fcntl`` (Windows) it guards nothing:
the chunk cache then opens as it did before the guard (the corpus lock needs ``fcntl`` anyway)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


@contextlib.contextmanager
def folder_guard(folder: Path, missing_ok: bool = False, best_effort: bool = False):
    """Hold an exclusive flock on ``folder`` for the ``with`` block, which gets whether it is held (not when
    ``missing_ok`` and it does not exist; not where the file system refuses the lock and ``best_effort``:
    NFS emulates flock with byte-range locks, which a folder opened read-only cannot take)."""
    if fcntl is None:
        yield False
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not missing_ok:
            raise
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        except OSError:
            if not best_effort:
                raise
            held = False
        yield held
    finally:
        os.close(fd)
