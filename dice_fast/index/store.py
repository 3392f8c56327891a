"""A `DiceIndex` on disk: a folder of ``.npy`` arrays and a JSON description.

    index.json               {"format": "dice_fast.index/1", "dim", "n_documents", "n_chunks",
                              "chunk_dtype", "store_text", "model", "encoder_options",
                              "files": {name: [shape, dtype]}}
    ids.json                 the document ids, in order
    texts.json               the document texts (only with store_text)
    documents.npy            (n_documents, dim) float32
    chunks.npy               (n_chunks, dim) float32 or float16
    cu_doc_chunks.npy        (n_documents + 1,) int64: document d owns chunks cu[d]:cu[d+1]
    chunk_start_char.npy, chunk_end_char.npy, chunk_tokens.npy   (n_chunks,) int64

Files are written under temporary names and renamed, ``index.json`` last, so a folder with an
``index.json`` is complete. `load` checks the format tag, every file's shape and dtype against
``index.json`` and the offsets' consistency, and refuses a damaged or foreign folder naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

FORMAT = "dice_fast.index/1"
_ARRAYS = ("documents", "chunks", "cu_doc_chunks", "chunk_start_char", "chunk_end_char", "chunk_tokens")


def save(index, path) -> None:
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} exists and is not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / "index.json").exists():
        raise ValueError(f"{folder} is a non-empty folder that holds no dice_fast index; refusing to write into it")
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in _ARRAYS:
        array = getattr(index, name)
        _atomic(folder / f"{name}.npy", lambda f, a=array: np.save(f, a, allow_pickle=False))
        files[f"{name}.npy"] = [list(array.shape), str(array.dtype)]
    _write_json(folder / "ids.json", index.ids)
    if index.store_text:
        _write_json(folder / "texts.json", index.texts)
    meta = {"format": FORMAT, "dim": index.dim, "n_documents": len(index), "n_chunks": index.n_chunks,
            "chunk_dtype": index.chunk_dtype, "store_text": index.store_text, "model": index.model,
            "encoder_options": index.encoder_options, "files": files}
    _write_json(folder / "index.json", meta)


def load(cls, path, encoder=None):
    folder = Path(path)
    meta_path = folder / "index.json"
    if not meta_path.is_file():
        raise ValueError(f"{folder} is not a dice_fast index (no index.json)")
    meta = _read_json(meta_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{meta_path}: format {found!r} is not {FORMAT!r}")
    try:
        dim, n_docs, n_chunks = int(meta["dim"]), int(meta["n_documents"]), int(meta["n_chunks"])
        index = cls(dim, encoder, store_text=bool(meta["store_text"]), chunk_dtype=meta["chunk_dtype"],
                    model=meta.get("model"), encoder_options=meta.get("encoder_options"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{meta_path}: damaged description ({exc})") from None
    want = {"documents": (n_docs, dim), "chunks": (n_chunks, dim), "cu_doc_chunks": (n_docs + 1,),
            "chunk_start_char": (n_chunks,), "chunk_end_char": (n_chunks,), "chunk_tokens": (n_chunks,)}
    dtypes = {"documents": "float32", "chunks": meta["chunk_dtype"]}
    for name in _ARRAYS:
        file = folder / f"{name}.npy"
        try:
            array = np.load(file, allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise ValueError(f"{file}: unreadable ({exc})") from None
        if array.shape != want[name] or str(array.dtype) != dtypes.get(name, "int64"):
            raise ValueError(f"{file}: shape {array.shape} {array.dtype}, expected {want[name]} "
                             f"{dtypes.get(name, 'int64')} as index.json says")
        setattr(index, name, array)
    cu = index.cu_doc_chunks
    if cu[0] != 0 or cu[-1] != n_chunks or np.any(np.diff(cu) < 0):
        raise ValueError(f"{folder / 'cu_doc_chunks.npy'}: chunk offsets are not 0..{n_chunks} in order")
    ids = _read_json(folder / "ids.json")
    if not isinstance(ids, list) or len(ids) != n_docs or not all(isinstance(i, str) for i in ids) or len(set(ids)) != n_docs:
        raise ValueError(f"{folder / 'ids.json'}: expected {n_docs} distinct string ids")
    index.set_ids(ids)
    if index.store_text:
        texts = _read_json(folder / "texts.json")
        if not isinstance(texts, list) or len(texts) != n_docs or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{folder / 'texts.json'}: expected {n_docs} texts")
        index.texts = texts
    return index


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, value) -> None:
    _atomic(path, lambda f: f.write(json.dumps(value, ensure_ascii=False).encode("utf-8")))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from None
