"""The approximate part of `DiceIndex`: faiss HNSW graphs over document or chunk vectors (inner
product), built on demand, extended in place when vectors are appended, saved with the index and
read back memory-mapped where faiss can (``pip install dice-fast[index]``: faiss-cpu).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HNSW_M = 32  # neighbours per node
EF_SEARCH = 128  # candidates kept while searching (recall vs time)
EF_CONSTRUCTION = 80


def faiss():
    try:
        import faiss as module
    except ImportError:
        raise ImportError("approximate search needs faiss: pip install 'dice_fast[index]' (faiss-cpu)") from None
    return module


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
            raise ValueError(f"{path}: unreadable faiss graph ({str(exc).splitlines()[0][:200]})") from None
    if graph.ntotal != expected:
        raise ValueError(f"{path}: the graph holds {graph.ntotal} vectors, the index {expected}")
    graph.hnsw.efSearch = EF_SEARCH
    return graph
