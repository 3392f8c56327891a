"""Reading the output of ``dice-fast encode`` back: ``(ids, vectors)`` in input order from a ``.npy``
(+ ids file), a ``.parquet`` file or a folder of shards (including ``--shard I/N`` splits)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import InputError, MissingFile, one_line, reading_parquet
from ..manifests import checked_shards, file_sha256, finished_manifests
from .outputs import IDS_RECORD, ids_path_for


def load_embeddings(path: str | os.PathLike, allow_incomplete: bool = False) -> tuple[list[str], np.ndarray]:
    """``(ids, vectors)`` of an output of ``dice-fast encode``, rows in input order, read whole into
    memory (the vectors once, and for a moment twice while shards or splits are joined; to stream an
    output, read its shards with pyarrow as `dice_fast.index` does).

    path: a ``.npy`` (ids from ``.ids.txt`` beside it), a ``.parquet`` file, or a shard folder. In a
    folder of split jobs (``--shard I/N``) every split must be complete and rows are interleaved back
    into input order (split ``I`` holds documents ``I, I+N, I+2N`` ...). ``allow_incomplete``: read the
    committed shards of an unfinished (unsplit) job instead of failing.

    Raises `InputError` (a ValueError) naming the files when ids and vectors do not agree: an ids file
    that is not the one committed with its ``.npy`` (row count and sha256 recorded in its first line),
    or a shard of another size, sha256 or row count than its manifest recorded at commit; and for one
    that cannot be read (truncated, a Parquet page failing its checksum, a manifest without the keys a
    job writes); `MissingFile` (a FileNotFoundError) for a file that is not there.
    """
    path = Path(path)
    if path.suffix.lower() == ".npy":
        return _read_npy(path)
    if not path.exists():
        raise MissingFile(f"{path} does not exist")
    if _is_parquet_file(path):
        return _read_parquet([path])
    splits = finished_manifests(path, allow_incomplete)
    dim = splits[0]["model"]["dim"]
    if len(splits) == 1:
        return _read_shards(path, splits[0], dim)
    count = len(splits)
    parts = [_read_shards(path, m, dim) for m in splits]
    total = sum(len(ids) for ids, _ in parts)
    ids_out: list = [None] * total
    vectors = np.zeros((total, dim), np.float32)
    for i, (ids, vecs) in enumerate(parts):
        if len(ids) != len(range(i, total, count)):
            raise InputError(f"{path}: split {i}/{count} has {len(ids)} rows; {len(range(i, total, count))} expected "
                             f"for {total} rows in all (were the splits run on the same input?)")
        ids_out[i::count] = ids
        if len(ids):
            vectors[i::count] = vecs
    return ids_out, vectors


def _is_parquet_file(path: Path) -> bool:
    return path.suffix.lower() == ".parquet" and path.is_file()


def _read_npy(path: Path) -> tuple[list[str], np.ndarray]:
    ids_path = ids_path_for(path)
    if not path.is_file():
        raise MissingFile(f"{path} does not exist" + (f" (but {ids_path.name} does: a job stopped while "
                                                      "committing? encode again with --overwrite)"
                                                      if ids_path.is_file() else ""))
    if not ids_path.is_file():
        raise MissingFile(f"{path} has no ids file {ids_path.name} beside it (a job stopped before "
                          "committing it? encode again with --overwrite)")
    try:
        lines = ids_path.read_text(encoding="utf-8").split("\n")[:-1]
    except UnicodeDecodeError as exc:
        raise InputError(f"{ids_path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    record = IDS_RECORD.match(lines[0]) if lines else None
    if record is not None:
        ids, rows, digest = lines[1:], int(record.group(1)), record.group(2)
        actual = file_sha256(path)
        if actual != digest:
            raise InputError(f"{ids_path} does not belong to {path.name}: it was committed with a vector file "
                             f"of {rows} rows and sha256 {digest[:12]}..., {path.name} has sha256 {actual[:12]}... "
                             "(a job stopped between committing the two files, or one was replaced); encode again "
                             "with --overwrite")
        if len(ids) != rows:
            raise InputError(f"{ids_path.name} records {rows} rows but lists {len(ids)} ids (edited after commit?)")
    else:  # an ids file without a record (written by hand or by an older version): counts only
        ids = lines
    try:
        vectors = np.load(path)
    except (ValueError, OSError, EOFError) as exc:  # truncated, damaged, or an array of objects
        raise InputError(f"{path}: not a readable .npy file ({one_line(exc)})") from None
    if vectors.ndim != 2 or len(vectors) != len(ids):
        raise InputError(f"{path.name} holds {vectors.shape[0] if vectors.ndim else 0} rows (shape "
                         f"{tuple(vectors.shape)}) but {ids_path.name} lists {len(ids)} ids; they are not one pair")
    return ids, vectors


def _read_shards(folder: Path, manifest: dict, dim: int) -> tuple[list[str], np.ndarray]:
    import pyarrow.parquet as pq

    files = checked_shards(folder, manifest)
    for f, shard in zip(files, manifest["shards"]):
        with reading_parquet(f):
            rows = pq.ParquetFile(f).metadata.num_rows
        if rows != shard["rows"]:
            raise InputError(f"{f}: {rows} rows, but its manifest lists {shard['rows']} (replaced after commit?)")
    return _read_parquet(files, dim)


def _read_parquet(files: list[Path], dim: int = 0) -> tuple[list[str], np.ndarray]:
    """Ids and vectors of ``files`` in order; ``dim``: the width of no rows (the files' own when they have any)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids: list[str] = []
    blocks = []
    for f in files:
        with reading_parquet(f):
            pf = pq.ParquetFile(f, page_checksum_verification=True)  # pages we wrote carry CRCs
        kinds = {name: pf.schema_arrow.field(name).type for name in pf.schema_arrow.names}
        if "id" not in kinds or not pa.types.is_fixed_size_list(kinds.get("embedding", pa.null())):
            raise InputError(f"{f}: not an output of dice-fast encode (no id column, or no embedding column of "
                             f"fixed-size lists; columns: {', '.join(kinds) or 'none'})")
        with reading_parquet(f):
            table = pf.read(columns=["id", "embedding"])
        ids.extend(table.column("id").to_pylist())
        emb = table.column("embedding").combine_chunks()
        dim = emb.type.list_size
        blocks.append(emb.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim))
    vectors = np.concatenate(blocks) if blocks else np.zeros((0, dim), np.float32)
    return ids, vectors.astype(np.float32, copy=False)
