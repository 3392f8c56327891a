"""A `DiceIndex` on disk: a folder of generation-named files and ``index.json`` naming the generation.

    index.json                   {"format": "dice_fast.index/2", "generation": G, "dim", "n_documents",
                                  "n_chunks", "chunk_dtype", "store_text", "model", "encoder_options",
                                  "files": {name: {"file", "shape", "dtype"}}, "graphs": {over: file},
                                  "chunks_of_text_only": true}
    documents.G.npy              (n_documents, dim) float32
    chunks.G.npy                 (n_chunks, dim) float32 or float16
    cu_doc_chunks.G.npy          (n_documents + 1,) int64: document d owns chunks cu[d]:cu[d+1]
    chunk_start_char.G.npy, chunk_end_char.G.npy, chunk_tokens.G.npy   (n_chunks,) int64
    ids.G.json                   the document ids, in order
    text_blob.G.npy, text_offsets.G.npy   (only with store_text) the texts as UTF-8 bytes (uint8) and
                                 (n_documents + 1,) int64 byte offsets: one hit reads one text
    graph_documents.G.faiss, graph_chunks.G.faiss   the faiss HNSW graphs built before saving (if any)

**Atomic saves.** A save writes every file of a new generation ``G`` (a random id) beside the old
ones, fsyncs them, then replaces ``index.json`` in one rename: a reader sees the old index or the
new one, never a mix, whenever the writer dies. Files of other generations are removed after the
switch; saves into one folder take turns (an exclusive ``flock`` on the folder, `dice_fast.folder_guard`:
threads and processes on a local disk). `load` opens only the files ``index.json`` names, checks
each one's shape and dtype and the offsets' consistency, and refuses a damaged or foreign folder
naming the file. ``mmap=True`` maps the vector files instead of reading them (pages come in as
search touches them). Folders of format ``dice_fast.index/1`` (plain names) still load. An index
saved before ``chunks_of_text_only`` was written may hold an empty text's chunk of special tokens
alone (0 tokens, which maxsim ranked first for short queries: RESULTS §30): `load` leaves such chunks
out (the chunk arrays then read into memory, its graphs rebuilt when next needed).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import numpy as np

from ..errors import InputError, MissingFile, WriteError, writing
from ..folder_guard import folder_guard
from ..scoring import unit_rows
from ..side_files import fsync_dir
from .common import short_repr
from .growth import COLUMNS
from .texts import TextColumn

FORMAT = "dice_fast.index/2"
LEGACY = "dice_fast.index/1"
UNIT_TOLERANCE = {"float32": 1e-4, "float16": 2e-3}  # |norm - 1| of a stored unit chunk row, by dtype
_TEXT_ARRAYS = ("text_blob", "text_offsets")
_GENERATION_FILE = re.compile(rf"^(?:{'|'.join((*COLUMNS, *_TEXT_ARRAYS, 'ids', 'graph_documents', 'graph_chunks'))})"
                              r"\.([0-9a-f]{12})\.(?:npy|json|faiss)$")
_TMP = ".index.json.tmp"
_LEGACY_FILES = {*(f"{name}.npy" for name in COLUMNS), "ids.json", "texts.json"}


LOAD_TRIES = 10  # generations a load reads before it gives up on a folder saved again and again meanwhile


class _Gone(InputError):
    """A file index.json names is missing (a save may have switched generations since it was read)."""


def check_destination(path) -> None:
    """Refuse, naming it, a ``path`` an index cannot be saved to: a file, a folder holding something else,
    one whose nearest existing folder is not writable. Checked by `save` and, before any encoding, by
    ``dice-fast index`` (it encoded the whole corpus first)."""
    folder = Path(path)
    if os.path.lexists(folder) and not folder.is_dir():
        raise InputError(f"{folder} exists and is not a folder{' (a link to nothing)' if not folder.exists() else ''}")
    _previous_format(folder)  # refuse a foreign folder before creating anything
    existing = next(p for p in (folder, *folder.absolute().parents) if os.path.lexists(p))
    if not existing.is_dir():
        raise InputError(f"cannot write {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise WriteError(f"cannot write {folder}: {existing} is not writable")


def save(index, path) -> None:
    folder = Path(path)
    check_destination(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with folder_guard(folder):  # saves into one folder, by threads or processes, run one after the other
        _save_generation(index, folder, _previous_format(folder))


def _save_generation(index, folder: Path, previous: str | None) -> None:
    gen = uuid.uuid4().hex[:12]
    try:
        graphs = _write_generation(index, folder, gen)
    except BaseException:  # a full disk, say: the old index stays, and nothing of this save
        if _current_generation(folder) != gen:  # (not when stopped right after its switch)
            for p in folder.iterdir():
                m = _GENERATION_FILE.match(p.name)
                if (m and m.group(1) == gen) or p.name == _TMP:
                    p.unlink(missing_ok=True)
        raise
    fsync_dir(folder)
    index.follow_saved_graphs({over: folder / name for over, name in graphs.items()})
    for stale in folder.iterdir():  # the old generation goes last
        m = _GENERATION_FILE.match(stale.name)
        if (m and m.group(1) != gen) or (previous == LEGACY and stale.name in _LEGACY_FILES):
            stale.unlink(missing_ok=True)


def _write_generation(index, folder: Path, gen: str) -> dict:
    """Write generation ``gen``'s files and switch index.json to them (the commit point); returns the
    graph files written ({over: file name})."""
    arrays = {name: getattr(index, name) for name in COLUMNS}
    if index.store_text:
        arrays["text_blob"], arrays["text_offsets"] = index.texts.arrays()
    files = {}
    for name, array in arrays.items():
        file = f"{name}.{gen}.npy"
        _write(folder / file, lambda f, a=array: np.save(f, np.asarray(a), allow_pickle=False))
        files[name] = {"file": file, "shape": list(array.shape), "dtype": str(array.dtype)}
    files["ids"] = {"file": f"ids.{gen}.json"}
    _write(folder / files["ids"]["file"], _json_writer(list(index.ids)))
    graphs = {}
    for over, graph in index.graphs().items():
        graphs[over] = f"graph_{over}.{gen}.faiss"
        _write(folder / graphs[over], lambda f, g=graph: f.write(_graph_bytes(g)))
    meta = {"format": FORMAT, "generation": gen, "dim": index.dim, "n_documents": len(index),
            "n_chunks": index.n_chunks, "chunk_dtype": index.chunk_dtype, "store_text": index.store_text,
            "model": index.model, "encoder_options": index.encoder_options, "files": files, "graphs": graphs,
            "chunks_of_text_only": True}  # no chunk of 0 tokens (`check_batch` stores none)
    tmp = folder / _TMP
    _write(tmp, _json_writer(meta))
    os.replace(tmp, folder / "index.json")  # the switch: before it the old index, after it the new one
    return graphs


def _current_generation(folder: Path) -> str | None:
    try:
        return json.loads((folder / "index.json").read_text(encoding="utf-8")).get("generation")
    except (OSError, ValueError, AttributeError):
        return None


def _previous_format(folder: Path) -> str | None:
    """The format of the index in ``folder`` (None: no index.json). Refuses a folder that holds
    something else: an index.json not ours, or other files than a save cut off before its switch."""
    meta_path = folder / "index.json"
    if meta_path.exists():
        try:
            text = meta_path.read_text(encoding="utf-8")
            meta = json.loads(text)
        except (OSError, ValueError) as exc:
            raise InputError(f"{meta_path} is not a dice_fast index ({exc}); refusing to overwrite {folder}") from None
        found = meta.get("format") if isinstance(meta, dict) else None
        if found not in (FORMAT, LEGACY):
            raise InputError(f"{meta_path} is not a dice_fast index (it holds {short_repr(text)}); refusing to "
                             f"overwrite {folder}")
        return found
    foreign = [p.name for p in folder.iterdir() if not (_GENERATION_FILE.match(p.name) or p.name == _TMP)] \
        if folder.is_dir() else []
    if foreign:
        raise InputError(f"{folder} is a non-empty folder that holds no dice_fast index (it holds {foreign[0]!r}); "
                         "refusing to write into it")
    return None


def load(cls, path, encoder=None, *, mmap: bool = True, device: str | None = None):
    folder = Path(path)
    meta = _read_meta(folder)
    for attempt in range(LOAD_TRIES):
        try:
            index = _read_generation(cls, folder, meta, mmap)
            break
        except _Gone as gone:  # a save switched generations after index.json was read and removed this one
            newer = _read_meta(folder)
            if newer.get("generation") == meta.get("generation"):
                raise
            if attempt == LOAD_TRIES - 1:
                raise InputError(f"{folder} was saved again {LOAD_TRIES} times while it was being read; load it when "
                                 "its writer pauses") from gone
            meta = newer  # read the new one
    index.attach_encoder(encoder, device=device, where=str(folder))
    return index


def _read_meta(folder: Path) -> dict:
    meta_path = folder / "index.json"
    if not folder.exists():
        raise MissingFile(f"{folder} does not exist")
    if not meta_path.is_file():
        raise InputError(f"{folder} is not a dice_fast index (no index.json)")
    meta = _read_json(meta_path)
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, LEGACY):
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise InputError(f"{meta_path}: format {found!r} is not {FORMAT!r}")
    return meta


def _read_generation(cls, folder: Path, meta: dict, mmap: bool):
    """The index of the files ``meta`` (index.json) names, each checked; `_Gone` when one is missing."""
    meta_path = folder / "index.json"
    try:
        dim, n_docs, n_chunks = int(meta["dim"]), int(meta["n_documents"]), int(meta["n_chunks"])
        store_text = bool(meta["store_text"])
        files = _file_names(meta, store_text)
        index = cls(dim, None, store_text=store_text, chunk_dtype=meta["chunk_dtype"], model=meta.get("model"),
                    encoder_options=meta.get("encoder_options"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InputError(f"{meta_path}: damaged description ({exc})") from None
    want = {"documents": ((n_docs, dim), "float32"), "chunks": ((n_chunks, dim), meta["chunk_dtype"]),
            "cu_doc_chunks": ((n_docs + 1,), "int64"), "text_offsets": ((n_docs + 1,), "int64")}
    for name in COLUMNS[3:]:
        want[name] = ((n_chunks,), "int64")
    loaded = {}
    for name in (*COLUMNS, *(_TEXT_ARRAYS if store_text and "texts" not in files else ())):
        file = folder / files[name]
        try:
            array = np.load(file, allow_pickle=False, mmap_mode="r" if mmap else None)
        except (OSError, ValueError, EOFError) as exc:
            raise _unreadable(file, exc) from None
        shape, dtype = want.get(name, ((None,), "uint8"))
        if (shape != (None,) and array.shape != shape) or array.ndim != len(shape) or str(array.dtype) != dtype:
            raise InputError(f"{file}: shape {array.shape} {array.dtype}, expected {shape} {dtype} as index.json says")
        loaded[name] = array
    if meta["format"] == LEGACY:
        loaded["chunks"] = _unit_chunks(loaded["chunks"])
    cu = np.asarray(loaded["cu_doc_chunks"])
    if cu[0] != 0 or cu[-1] != n_chunks or np.any(np.diff(cu) < 0):
        raise InputError(f"{folder / files['cu_doc_chunks']}: chunk offsets are not 0..{n_chunks} in order")
    ids = _read_json(folder / files["ids"])
    if not isinstance(ids, list) or len(ids) != n_docs or not all(isinstance(i, str) for i in ids) or len(set(ids)) != n_docs:
        raise InputError(f"{folder / files['ids']}: expected {n_docs} distinct string ids")
    texts = None
    if store_text and "texts" in files:  # legacy: one JSON list
        listed = _read_json(folder / files["texts"])
        if not isinstance(listed, list) or len(listed) != n_docs or not all(isinstance(t, str) for t in listed):
            raise InputError(f"{folder / files['texts']}: expected {n_docs} texts")
        texts = TextColumn.from_texts(listed)
    elif store_text:
        try:
            texts = TextColumn(loaded.pop("text_blob"), loaded.pop("text_offsets"))
        except ValueError as exc:
            raise InputError(f"{folder / files['text_offsets']}: {exc}") from None
    graphs = {over: folder / name for over, name in (meta.get("graphs") or {}).items()}
    if meta.get("chunks_of_text_only") is not True and np.any(np.asarray(loaded["chunk_tokens"]) == 0):
        loaded, graphs = _without_empty_chunks(loaded), {}  # the graphs number the chunks left out
    index.restore(ids, loaded, texts, graphs)
    return index


def _without_empty_chunks(loaded: dict) -> dict:
    """The arrays read with their chunks of 0 tokens left out (in memory), the offsets renumbered."""
    keep = np.asarray(loaded["chunk_tokens"]) != 0
    out = dict(loaded, cu_doc_chunks=np.concatenate([[0], np.cumsum(keep)])[np.asarray(loaded["cu_doc_chunks"])])
    for name in ("chunks", "chunk_start_char", "chunk_end_char", "chunk_tokens"):
        out[name] = np.asarray(loaded[name])[keep]
    return out


def _unit_chunks(chunks: np.ndarray) -> np.ndarray:
    """The chunk vectors of a ``dice_fast.index/1`` folder as this version stores them, unit length: the
    first of those (before 0.2) stored them as the encoder gave them, raw with ``normalize_chunks=False``,
    and MaxSim scored their norms (a loaded one ranked silently wrong, and rows added beside them unit
    length). Rows already unit length are returned untouched (read into memory only when rescaled)."""
    norms = np.linalg.norm(np.asarray(chunks, np.float32), axis=1)
    if np.all((norms == 0) | (np.abs(norms - 1) <= UNIT_TOLERANCE[str(chunks.dtype)])):
        return chunks
    return unit_rows(chunks).astype(chunks.dtype)


def _graph_bytes(graph) -> bytes:
    """A faiss graph serialized, or the bytes of a saved one not read (no faiss needed to copy it)."""
    if isinstance(graph, Path):
        return graph.read_bytes()
    import faiss

    return faiss.serialize_index(graph).tobytes()


def _file_names(meta: dict, store_text: bool) -> dict:
    if meta["format"] == LEGACY:
        names = {name: f"{name}.npy" for name in COLUMNS}
        names["ids"] = "ids.json"
        if store_text:
            names["texts"] = "texts.json"
        return names
    gen = meta["generation"]
    names = {name: entry["file"] for name, entry in meta["files"].items()}
    needed = [*COLUMNS, "ids", *(_TEXT_ARRAYS if store_text else ())]
    for name in needed:
        if not re.fullmatch(rf"{name}\.{gen}\.(npy|json)", names.get(name, "")):
            raise InputError(f"file of {name!r} is {names.get(name)!r}, not one of generation {gen}")
    return names


def _write(path: Path, write) -> None:
    with writing(path), open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _json_writer(value):
    return lambda f: f.write(json.dumps(value, ensure_ascii=False).encode("utf-8"))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None


def _unreadable(path: Path, exc: Exception) -> InputError:
    return (_Gone if isinstance(exc, FileNotFoundError) else InputError)(f"{path}: unreadable ({exc})")
