"""The hidden files dice_fast puts beside a file it writes, and replacing a file whole or not at all.

A file that is written in place and cut short (a full disk, a kill, a power loss) loses the previous
one. So every file a reader may find is written as a hidden temporary beside it, fsynced, renamed
over it, and its folder fsynced. The side files' names (a temporary, a lock) are the file's name with
a few bytes around it, or a digest of that name where they would pass what one file name holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import secrets
from pathlib import Path

NAME_MAX = 255  # bytes of one file name (Linux, macOS)
_TEMP_EXTRA = len("..00000000.tmp")


def side_stem(name: str, extra: int) -> str:
    """``name`` as the stem of a hidden file beside it, ``extra`` bytes longer (a temporary, a lock):
    itself when that fits a file name, else a digest of it (an output named with 239-255 bytes was
    refused, "File name too long", naming a lock file the user never gave)."""
    raw = name.encode("utf-8", "surrogateescape")
    return name if len(raw) + extra <= NAME_MAX else "~" + hashlib.sha256(raw).hexdigest()[:32]


def temp_stem(name: str) -> str:
    """The NAME of ``.NAME.XXXXXXXX.tmp``, the temporaries `new_temp` makes for a file named ``name``."""
    return side_stem(name, _TEMP_EXTRA)


def new_temp(folder: Path, name: str) -> Path:
    """A new hidden temporary file ``.NAME.XXXXXXXX.tmp`` in ``folder`` for the file ``name`` (NAME:
    `temp_stem`; mode 0666 less the umask, as the final file should have; unique across threads and
    processes)."""
    stem = temp_stem(name)
    for attempt in itertools.count(1):
        path = Path(folder) / f".{stem}.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            if attempt == 100:  # every name taken: something else is making them; the OSError names the last
                raise


def fsync_dir(path: Path) -> None:
    """Make a rename in folder ``path`` durable (where the file system lets a folder be fsynced)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_file(path, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` whole or not at all: a temporary beside it, fsynced,
    renamed over it, the folder fsynced. On any error the temporary is removed and the old file kept."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = new_temp(path.parent, path.name)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())  # a power loss must not leave an empty file in its place
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
