"""The approximate part of `DiceIndex`: faiss HNSW graphs over document or chunk vectors (inner
product), built on demand, extended in place when vectors are appended, saved with the index and
read back memory-mapped where faiss can (``pip install dice-fast[index]``: faiss-cpu).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from ..errors import InputError, require

HNSW_M = 32  # neighbours per node
EF_SEARCH = 128  # candidates kept while searching (recall vs time)
EF_CONSTRUCTION = 80


def faiss():
    return require("faiss", extra="index", needed_by="approximate search", hint=" (faiss-cpu)")


def build(vectors: np.ndarray):
    """An HNSW graph over ``vectors`` (n, dim), searched by inner product."""
    f = faiss()
    graph = f.IndexHNSWFlat(vectors.shape[1], HNSW_M, f.METRIC_INNER_PRODUCT)
    graph.hnsw.efConstruction = EF_CONSTRUCTION
    graph.hnsw.efSearch = EF_SEARCH
    extend(graph, vectors)
    return graph


def extend(graph, vectors: np.ndarray) -> None:
    """Append ``vectors`` (n, dim) to ``graph`` (their ids continue its numbering)."""
    if len(vectors):
        graph.add(np.ascontiguousarray(vectors, np.float32))


def read(path: Path, expected: int):
    """A graph saved by `dice_fast.index.folder` (memory-mapped when faiss can), checked to hold
    ``expected`` vectors."""
    f = faiss()
    try:
        graph = f.read_index(str(path), f.IO_FLAG_MMAP | f.IO_FLAG_READ_ONLY)
    except RuntimeError:
        try:
            graph = f.read_index(str(path))
        except RuntimeError as exc:
            raise InputError(f"{path}: unreadable faiss graph ({str(exc).splitlines()[0][:200]})") from None
    if graph.ntotal != expected:
        raise InputError(f"{path}: the graph holds {graph.ntotal} vectors, the index {expected}")
    graph.hnsw.efSearch = EF_SEARCH
    return graph


class Graphs:
    """The graphs of one index, by what they are over ("documents" or "chunks"): each built (or read
    from the file the index was loaded with) when first asked for, by one thread while others wait;
    extended in place when vectors are appended, except a graph read from a file (read-only: dropped,
    rebuilt when next asked for)."""

    def __init__(self, files: dict | None = None):
        self._built: dict = {}  # over -> faiss graph built or read here
        self._files = dict(files or {})  # over -> a saved graph not read yet
        self._read_only: set = set()  # graphs read (memory-mapped) from a file
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # pickled: saved graphs by file; built ones (faiss objects) rebuilt later
        with self._lock:
            return {"files": dict(self._files)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["files"])

    def get(self, over: str, vectors: np.ndarray):
        """The graph over ``vectors`` (n, dim), the index's document or chunk vectors as ``over`` says."""
        with self._lock:
            if over not in self._built:
                file = self._files.pop(over, None)
                if file is not None and Path(file).is_file():
                    self._built[over] = read(file, len(vectors))
                    self._read_only.add(over)
                else:
                    self._built[over] = build(vectors)
            return self._built[over]

    def append(self, documents: np.ndarray, chunks: np.ndarray) -> None:
        """Vectors were appended to the index (whose writer holds it alone): extend the graphs."""
        self._files.clear()  # saved graphs are read-only: rebuilt when next needed
        for over in self._read_only:
            self._built.pop(over, None)
        self._read_only.clear()
        for over, graph in self._built.items():
            extend(graph, documents if over == "documents" else chunks)

    def current(self) -> dict:
        """{over: a graph built or read so far, or the Path of a saved graph not read yet}."""
        with self._lock:
            return {**{over: Path(f) for over, f in self._files.items() if Path(f).is_file()}, **self._built}

    def moved(self, files: dict) -> None:
        """A saved graph not read yet is read from its new file in ``files`` ({over: Path}) from now on."""
        with self._lock:
            for over, file in files.items():
                if over in self._files:
                    self._files[over] = file
