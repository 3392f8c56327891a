"""The on-disk cache of exported OpenVINO models: written atomically, checked when read, repaired.

    model_cache.save(ov_model, folder)                      # folder/model.xml, model.bin, model.sha256
    model = model_cache.read_or_write(core, folder, write)   # read; written first by write(folder) where absent
    model_cache.cached_models(cache_root, "int8")            # the keys stored

A folder is written under a temporary name and renamed into place, so a reader sees a whole model
or none; `CHECKSUM` holds the SHA-256 of its model.xml and model.bin, checked once per process and
file version (~0.7 s per GB). A model that fails the check (bytes changed on disk, which OpenVINO
would read and run) or that OpenVINO cannot read is set aside and written again, with a warning
naming it; a model another process put in its place meanwhile is read, never discarded. A folder
that cannot be written, or a full disk, is an `InputError` naming the cache and
``DICE_FAST_CACHE_DIR``, raised before the (minutes-long) export and quantization where it can be.
A read marks its entry used (`LAST_USED`); writing an entry removes those beside it unused for
`UNUSED_DAYS` (keys hold the library versions: an upgrade leaves every older entry, a model's size each).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import NoReturn

from ..errors import InputError
from ..folder_guard import folder_guard

CHECKSUM = "model.sha256"
LAST_USED = "last_used"  # its modification time: when the entry was last read (or written)
UNUSED_DAYS = 30


def save(ov_model, out: Path) -> None:
    """Write ``ov_model`` as ``out/model.xml`` (and ``model.bin``, `CHECKSUM`) atomically: a reader sees a
    whole model or none."""
    import openvino as ov

    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:  # the folder went away or read-only since `read_or_write` checked it
        _unwritable(out, exc)
    try:
        try:
            ov.save_model(ov_model, str(tmp / "model.xml"), compress_to_fp16=False)
            (tmp / CHECKSUM).write_text(checksum(tmp), encoding="utf-8")
        except (RuntimeError, OSError) as exc:  # a full disk: OpenVINO's "basic_ios::clear: iostream error"
            raise InputError(f"cannot write the OpenVINO model cache {out.parent} ({_first_line(exc)}; is the "
                             "disk full?): free space or point DICE_FAST_CACHE_DIR at another folder") from exc
        with contextlib.suppress(OSError):  # another process won the race: its model is the same
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def checksum(folder: Path) -> str:
    """SHA-256 (hex) of ``folder``'s model.xml and model.bin, as `CHECKSUM` holds it."""
    h = hashlib.sha256()
    for name in ("model.xml", "model.bin"):
        with open(folder / name, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        h.update(b"|")
    return h.hexdigest()


_VERIFIED: set = set()  # (folder, `_identity` of model.xml and model.bin) checked in this process


def _verified(folder: Path) -> bool:
    """Whether ``folder``'s model matches its `CHECKSUM` (hashed once per process and file version:
    ~0.7 s per GB of weights; FileNotFoundError where a file is missing)."""
    stats = (_identity(folder / "model.xml"), _identity(folder / "model.bin"))  # a missing one: checksum() says so
    if None not in stats and (str(folder), stats) in _VERIFIED:
        return True
    if checksum(folder) != (folder / CHECKSUM).read_text(encoding="utf-8").strip():
        return False
    _VERIFIED.add((str(folder), stats))
    return True


def _first_line(exc: Exception) -> str:
    """The first informative line of an OpenVINO error (its messages open with "Exception from ...")."""
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip() and "Exception from" not in ln),
                str(exc))[:200]


def read_or_write(core, folder: Path, write):
    """``folder/model.xml`` read by ``core``, written by ``write(folder)`` first where absent. A cached
    model OpenVINO cannot read (damaged on disk: a truncated weights file, a folder without its model)
    is set aside and written again, with a warning naming it: damage costs a rebuild, not an error. A
    model another process put in its place meanwhile is read, never discarded. Processes (and threads)
    that find entries of one kind missing together write them one at a time (a flock on the kind's
    folder): the first writes, the others wait and then read what it wrote (N workers started at once
    quantize a model once, not N times; two models' writes of one kind take turns)."""
    model = _read_cached(core, folder)
    if model is not None:
        return model
    try:  # before the export (and int8's quantization, minutes on a slow machine): can its result be kept?
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".probe", dir=folder.parent))
    except OSError as exc:
        _unwritable(folder, exc)
    with folder_guard(folder.parent, best_effort=True):
        model = _read_cached(core, folder)  # written meanwhile by the process the lock waited for
        if model is not None:
            return model
        _remove_leftovers(folder)
        _remove_unused(folder.parent)
        write(folder)
        _mark_used(folder)
        return core.read_model(str(folder / "model.xml"))


def _read_cached(core, folder: Path):
    """The model of the entry ``folder`` read by ``core``; None where there is none, or a damaged one
    (set aside, with a warning) that no other process replaced meanwhile."""
    xml = folder / "model.xml"
    for _ in range(2):  # a second look where another process replaced the damaged model meanwhile
        seen = _identity(xml)
        if seen is None and not folder.exists():
            return None
        damage = "holds no model.xml"
        if seen is not None:
            try:
                if _verified(folder):
                    model = core.read_model(str(xml))
                    _mark_used(folder)
                    _remove_leftovers(folder)  # a writer killed while another wrote the entry left its own
                    return model
                damage = "does not match its checksum (changed on disk)"
            except FileNotFoundError as exc:
                damage = f"lacks {Path(exc.filename or CHECKSUM).name}"
            except RuntimeError as exc:
                damage = f"cannot be read ({_first_line(exc)})"
            except OSError as exc:
                damage = f"cannot be read ({exc.strerror or exc})"
        if _identity(xml) == seen:  # still the damaged one (or still none): set it aside
            warnings.warn(f"the cached OpenVINO model {folder} {damage}; it is built again", stacklevel=3)
            _set_aside(folder)
            return None
    return None


def _mark_used(folder: Path) -> None:
    """Record that the entry ``folder`` was used now (a read-only cache is left as it is)."""
    with contextlib.suppress(OSError):
        (folder / LAST_USED).touch()


def _remove_unused(root: Path) -> None:
    """Delete the entries of ``root`` not used for `UNUSED_DAYS` (by their `LAST_USED`, else their
    `CHECKSUM`: entries written before the mark), each moved aside first so no reader sees half of one."""
    cutoff = time.time() - UNUSED_DAYS * 86400
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.name.startswith(".") or not (entry / CHECKSUM).is_file():
            continue
        try:
            used = max(p.stat().st_mtime for p in (entry / LAST_USED, entry / CHECKSUM) if p.exists())
        except (OSError, ValueError):  # removed meanwhile
            continue
        if used < cutoff:
            with contextlib.suppress(InputError):
                _set_aside(entry)


LEFTOVER_AGE_S = 3600  # a live write changes its files every second; one untouched for an hour was killed


def _remove_leftovers(folder: Path) -> None:
    """Delete the temporary folders (``.KEY.*.tmp``, ``.discarded``, ``.probe``) that a process killed
    while writing, or setting aside, the entry ``folder`` left beside it: a model's size each. Only
    those whose files have not changed for `LEFTOVER_AGE_S` (another process may be writing one now)."""
    now = time.time()
    for p in folder.parent.glob(f".{glob.escape(folder.name)}.*"):
        if p.suffix not in (".tmp", ".discarded", ".probe"):
            continue
        try:
            newest = max([p.stat().st_mtime, *(c.stat().st_mtime for c in p.rglob("*"))])
        except OSError:  # removed meanwhile
            continue
        if now - newest > LEFTOVER_AGE_S:
            shutil.rmtree(p, ignore_errors=True)


def _set_aside(folder: Path) -> None:
    """Move the damaged cache entry ``folder`` out of the way (another process may have done so first)
    and delete it; InputError naming it where that is not allowed."""
    aside = None
    try:
        aside = tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".discarded", dir=folder.parent)
        with contextlib.suppress(FileNotFoundError):  # another process set it aside first
            os.replace(folder, aside)
    except OSError as exc:
        raise InputError(f"the damaged OpenVINO cache entry {folder} cannot be replaced ({exc.strerror or exc}): "
                         "delete it, or point DICE_FAST_CACHE_DIR at a writable folder") from exc
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def _identity(path: Path) -> tuple | None:
    """(inode, modification time, size) of the file at ``path``, None where there is none."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError as exc:  # a cache folder shared with another user (entries are made 0700)
        raise InputError(f"cannot read the OpenVINO model cache {path.parent} ({exc.strerror or exc}): point "
                         "DICE_FAST_CACHE_DIR at a folder of your own") from exc
    return st.st_ino, st.st_mtime_ns, st.st_size


def _unwritable(folder: Path, exc: OSError) -> NoReturn:
    """Raise the InputError for a model cache folder ``folder`` that ``exc`` says cannot be written."""
    raise InputError(f"cannot write the OpenVINO model cache {folder.parent} ({exc.strerror or exc}): point "
                     "DICE_FAST_CACHE_DIR at a writable folder") from exc


def cached_models(cache_root: Path, kind: str = "int8") -> list[str]:
    """Keys of the models stored under ``cache_root``: quantized (``kind`` "int8") or float exports
    ("openvino"); for tests and housekeeping."""
    folder = Path(cache_root) / kind
    if not folder.is_dir():
        return []
    # dot-prefixed: a write under way or left by a killed process (".<key>.*.tmp"), or one set aside
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and (p / "model.xml").is_file())
