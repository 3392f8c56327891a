"""Reading the output of ``dice-fast encode ... --chunks`` (a ``.parquet`` file or a folder of Parquet
shards listed by ``manifest*.json``) as the arrays a `DiceIndex` holds.

The columns (``id``, ``embedding``, ``chunk_embeddings``, ``chunk_start_char``, ``chunk_end_char``,
``chunk_tokens``) are the documented output format of the encode command; this module reads them with
pyarrow, once `dice_fast.manifests` finds the job finished (every split present and complete).
Rows come in file order (for a split job, split by split); an index does not depend on the order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import InputError, MissingFile, reading_parquet
from ..manifests import checked_shards, finished_manifests

NEEDED = ("id", "embedding", "chunk_embeddings", "chunk_start_char", "chunk_end_char", "chunk_tokens")


def corpus_files(path, check: bool = True) -> list[Path]:
    """The Parquet files of an encode output: the file itself, or the shards every manifest lists.
    `InputError` for a folder whose job is unfinished or misses a ``--shard I/N`` split (an index of it
    would silently lack documents), or a shard not as its manifest recorded it (`checked_shards`; with
    ``check=False`` only that it is there, of its size: its sha256 costs a full read of each file)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise MissingFile(f"{path}: no such file or folder")
    try:
        manifests = finished_manifests(path)
    except ValueError as exc:
        raise InputError(f"{exc}; index a finished output (encode ... --resume, every split)") from None
    return [f for m in manifests for f in checked_shards(path, m, digest=check)]


def read_ids(file: Path):
    """Yield the ids of one Parquet file of an encode output, a row group's at a time, as strings."""
    import pyarrow.parquet as pq

    with reading_parquet(file):
        pf = pq.ParquetFile(file, page_checksum_verification=True)
        for g in range(pf.num_row_groups):
            yield [str(i) for i in pf.read_row_group(g, columns=["id"]).column("id").to_pylist()]


def check_chunk_columns(file: Path, names, use: str) -> None:
    """`InputError` naming ``file`` unless its columns ``names`` hold every `NEEDED` one (an output encoded
    without ``--chunks`` has no chunk columns to ``use``: "index", "push")."""
    if missing := [c for c in NEEDED if c not in names]:
        raise InputError(f"{file}: no {', '.join(missing)} column(s); encode with --chunks to {use} the output")


def read_corpus_parts(file: Path):
    """Yield, per row group of one Parquet file of an encode output (4,096 rows as encode writes them;
    memory of one row group, never the output's): (ids list, documents (n, dim) float32, chunks
    (n_chunks, dim) float32, chunk_document (n_chunks,) int64, start_char, end_char, tokens (n_chunks,)
    int64)."""
    import pyarrow.parquet as pq

    with reading_parquet(file):
        pf = pq.ParquetFile(file, page_checksum_verification=True)  # pages we wrote carry CRCs
        check_chunk_columns(file, pf.schema_arrow.names, "index")
        for g in range(pf.num_row_groups):
            yield _arrays(file, pf.read_row_group(g))


def _arrays(file: Path, table) -> tuple:
    n = table.num_rows
    documents = _matrix(table.column("embedding").combine_chunks(), n)
    lists = table.column("chunk_embeddings").combine_chunks()
    offsets = np.asarray(lists.offsets, np.int64)
    chunks = _matrix(lists.flatten(), int(offsets[-1] - offsets[0]))
    chunk_document = np.repeat(np.arange(n, dtype=np.int64), np.diff(offsets))
    spans = [np.asarray(table.column(c).combine_chunks().flatten(), np.int64) for c in NEEDED[3:]]
    if any(len(s) != len(chunks) for s in spans):
        raise InputError(f"{file}: chunk spans and chunk vectors differ in count")
    return ([str(i) for i in table.column("id").to_pylist()], documents, chunks, chunk_document, *spans)


def _matrix(fixed_lists, rows: int) -> np.ndarray:
    values = np.asarray(fixed_lists.flatten(), np.float32)
    return values.reshape(rows, -1) if rows else values.reshape(0, fixed_lists.type.list_size)


def corpus_encoder(path) -> tuple[str | None, dict, int]:
    """(model folder, or `BUNDLED` for the bundled one; DICE options; the vectors' width) the encode job
    recorded in its first Parquet file, for a query encoder that matches its vectors. `InputError`
    naming the file for one that cannot be read or is not an output of ``dice-fast encode`` (a Parquet
    corpus of texts: the message says how to make an output of it)."""
    from .encoder_match import BUNDLED

    import pyarrow.parquet as pq

    file = corpus_files(path, check=False)[0]
    with reading_parquet(file):
        schema = pq.read_schema(file)
    if b"dice_fast" not in (schema.metadata or {}):
        raise InputError(f"{file}: not an output of `dice-fast encode --chunks` (no dice_fast record in its "
                         f"metadata); to index a Parquet corpus of texts, encode it first: dice-fast encode {file} "
                         "-o OUT.parquet --chunks [--field TEXT_COLUMN --id-field ID_COLUMN], then dice-fast index "
                         "OUT.parquet -o INDEX")
    try:
        options = dict(json.loads(schema.metadata[b"dice_fast"])["options"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{file}: no dice_fast options in its metadata ({exc})") from None
    try:
        dim = int(schema.field("embedding").type.list_size)
    except (KeyError, AttributeError) as exc:
        raise InputError(f"{file}: no embedding column of fixed-size lists ({exc})") from None
    model = options.pop("model", None)
    options.pop("chunks", None)
    return (BUNDLED if model is None or model.startswith("(bundled") else model), options, dim
