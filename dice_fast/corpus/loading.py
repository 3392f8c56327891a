"""Reading the output of ``dice-fast encode`` back: ``(ids, vectors)`` in input order from a ``.npy``
(+ ids file), a ``.parquet`` file or a folder of shards (including ``--shard I/N`` splits)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .outputs import ids_path_for, read_manifest


def load_embeddings(path: str | os.PathLike, allow_incomplete: bool = False) -> tuple[list[str], np.ndarray]:
    """``(ids, vectors)`` of an output of ``dice-fast encode``, rows in input order.

    path: a ``.npy`` (ids from ``.ids.txt`` beside it), a ``.parquet`` file, or a shard folder. In a
    folder of split jobs (``--shard I/N``) every split must be complete and rows are interleaved back
    into input order (split ``I`` holds documents ``I, I+N, I+2N`` ...). ``allow_incomplete``: read the
    committed shards of an unfinished (unsplit) job instead of failing.
    """
    path = Path(path)
    if path.suffix == ".npy":
        vectors = np.load(path)
        ids = ids_path_for(path).read_text(encoding="utf-8").split("\n")[:-1]
        return ids, vectors
    if path.suffix == ".parquet" and path.is_file():
        return _read_parquet([path])
    manifests = sorted(path.glob("manifest*.json"))
    if not manifests:
        raise FileNotFoundError(f"no manifest*.json in {path}")
    if len(manifests) == 1 and manifests[0].name == "manifest.json":
        m = read_manifest(manifests[0])
        if m["status"] != "complete" and not allow_incomplete:
            raise ValueError(f"{manifests[0]}: the job is not complete ({m['rows']} rows committed)")
        return _read_parquet([path / s["file"] for s in m["shards"]])
    splits = [read_manifest(p) for p in manifests]
    count = splits[0]["split"]["count"]
    have = {m["split"]["index"]: m for m in splits if m["split"]["count"] == count}
    if len(have) != len(splits) or sorted(have) != list(range(count)):
        raise ValueError(f"{path}: split manifests {[p.name for p in manifests]} are not the {count} splits of one job")
    parts = []
    for i in range(count):
        m = have[i]
        if m["status"] != "complete":
            raise ValueError(f"{path}: split {i}/{count} is not complete ({m['rows']} rows committed)")
        parts.append(_read_parquet([path / s["file"] for s in m["shards"]]))
    total = sum(len(ids) for ids, _ in parts)
    dim = next((v.shape[1] for _, v in parts if v.ndim == 2 and v.shape[0]), 0)
    ids_out: list = [None] * total
    vectors = np.zeros((total, dim), np.float32)
    for i, (ids, vecs) in enumerate(parts):
        if len(ids) != len(range(i, total, count)):
            raise ValueError(f"{path}: split {i}/{count} has {len(ids)} rows; {len(range(i, total, count))} expected "
                             f"for {total} rows in all (were the splits run on the same input?)")
        ids_out[i::count] = ids
        if len(ids):
            vectors[i::count] = vecs
    return ids_out, vectors


def _read_parquet(files: list[Path]) -> tuple[list[str], np.ndarray]:
    import pyarrow.parquet as pq

    ids: list[str] = []
    blocks = []
    dim = 0
    for f in files:
        table = pq.read_table(f)
        ids.extend(table.column("id").to_pylist())
        emb = table.column("embedding").combine_chunks()
        dim = emb.type.list_size
        blocks.append(emb.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim))
    vectors = np.concatenate(blocks) if blocks else np.zeros((0, dim), np.float32)
    return ids, vectors.astype(np.float32, copy=False)
