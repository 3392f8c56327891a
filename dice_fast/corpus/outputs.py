"""Where vectors go: a ``.npy`` (+ ids file), a single ``.parquet``, or a folder of Parquet shards with
a manifest (read back by `dice_fast.corpus.loading.load_embeddings`).

Every writer streams (memory bounded by one row group, never by the corpus) into hidden temporary
files in the target folder and makes them visible only by ``os.replace`` after ``fsync``:

* ``.npy``: rows are appended to the temporary file behind a fixed-size header that is rewritten with
  the final row count at the end, so no count pass is needed (stdin works too). The ids go to
  ``NAME.ids.txt`` beside it: a first line ``#dice_fast-ids rows=N vectors_sha256=HEX`` recording the
  vector file it belongs to, then one id per line (row ``i`` is line ``i + 2``). The ``.npy`` is
  renamed into place first, the ids file last: the ids file is the commit point, and a job stopped
  between the two renames leaves a pair whose record does not match, which `load_embeddings` refuses.
* ``.parquet``: one file with columns ``id`` (string) and ``embedding`` (fixed-size list of float32),
  the options in the file's key-value metadata under ``dice_fast``. With ``--chunks`` each row also has
  `CHUNK_COLUMNS`: ``chunk_embeddings`` (list of fixed-size lists of float32, the document's chunk
  vectors in order), ``chunk_start_char`` / ``chunk_end_char`` (list of int64: chunk ``c`` is
  ``text[start:end]``) and ``chunk_tokens`` (list of int64 content tokens), so the output can be
  indexed (``DiceIndex.from_corpus``). Shards of a folder carry the same columns.
* a folder: shards ``part-00000.parquet``, ``part-00001.parquet`` ... of ``shard_rows`` rows each and
  ``manifest.json``. A shard is written to a temporary name, fsynced and renamed; then the manifest
  listing it is rewritten the same way. The manifest is the commit point: a shard file not listed in
  it (a run killed between the two renames) is rewritten on ``--resume``. With ``--shard I/N`` the
  names carry the split: ``part-1of4-00000.parquet``, ``manifest-1of4.json``, so the processes of one
  split can share a folder. Replacing an output (``replace``: its files) keeps every shard under its
  temporary name until the job finishes, then renames them to names the old output does not use
  (``part-00000-RUN.parquet``, ``RUN`` 8 hex digits), replaces the manifest (the commit point: a reader
  sees the old output or the new one, never neither) and only then removes the old files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import struct
from pathlib import Path

import numpy as np

from .chunk_rows import CHUNK_COLUMNS, ChunkRows
from ..manifests import file_sha256
from ..side_files import fsync_dir, new_temp, replace_file, temp_stem

_ROW_GROUP = 4096
_NPY_HEADER = 128  # bytes: magic, version, length, and the header dict padded with spaces
_IDS_HEADER = 128  # bytes: the ids file's first line, padded with spaces
IDS_RECORD = re.compile(r"^#dice_fast-ids rows=(\d+) vectors_sha256=([0-9a-f]{64}) *$")
_OUR_FILES = re.compile(r"^(manifest(-\d+of\d+)?\.json|part(-\d+of\d+)?-\d{5,}(-[0-9a-f]{8})?\.parquet)$")
_OUR_TEMPS = re.compile(r"^\.(manifest|part)(-\d+of\d+)?[-.].*\.tmp$")


def split_tag(index: int, count: int) -> str:
    """The name tag of split ``index`` of ``count``: "" for an unsplit job, else ``-INDEXofCOUNT``."""
    return "" if count == 1 else f"-{index}of{count}"


def manifest_name(tag: str) -> str:
    return f"manifest{tag}.json"


def shard_name(tag: str, k: int, run: str = "") -> str:
    """Shard ``k`` of split ``tag``; ``run``: ``-XXXXXXXX`` for the shards of a job replacing an output."""
    return f"part{tag}-{k:05d}{run}.parquet"


def _fsync_and_hash(path: Path) -> tuple[int, str]:
    digest = file_sha256(path, fsync=True)
    return path.stat().st_size, digest


def _schema(dim: int, metadata: dict, chunks: bool = False):
    import pyarrow as pa

    fields = [("id", pa.string()), ("embedding", pa.list_(pa.float32(), dim))]
    if chunks:
        fields += [("chunk_embeddings", pa.list_(pa.list_(pa.float32(), dim)))]
        fields += [(name, pa.list_(pa.int64())) for name in CHUNK_COLUMNS[1:]]
    return pa.schema(fields, metadata={"dice_fast": json.dumps(metadata, sort_keys=True)})


def _table(ids: list[str], vectors: np.ndarray, schema, chunks: ChunkRows | None = None):
    import pyarrow as pa

    flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1), type=pa.float32())
    emb = pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])
    columns = [pa.array(ids, type=pa.string()), emb] + (chunks.arrow_columns() if chunks is not None else [])
    return pa.Table.from_arrays(columns, schema=schema)


class _ParquetStream:
    """Rows appended to one Parquet file in row groups of `_ROW_GROUP` rows."""

    def __init__(self, path: Path, dim: int, metadata: dict, chunks: bool = False):
        import pyarrow.parquet as pq

        self.schema = _schema(dim, metadata, chunks)
        self.writer = pq.ParquetWriter(str(path), self.schema, write_page_checksum=True)  # readers verify them
        self.ids: list[str] = []
        self.blocks: list[np.ndarray] = []
        self.chunk_blocks: list[ChunkRows] | None = [] if chunks else None
        self.pending = 0

    def write(self, ids: list[str], block: np.ndarray, chunks: ChunkRows | None = None) -> None:
        self.ids.extend(ids)
        self.blocks.append(block)
        if self.chunk_blocks is not None:
            self.chunk_blocks.append(chunks)
        self.pending += len(block)
        if self.pending >= _ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            chunks = ChunkRows.concat(self.chunk_blocks) if self.chunk_blocks else None
            self.writer.write_table(_table(self.ids, np.concatenate(self.blocks), self.schema, chunks))
            self.ids, self.blocks, self.pending = [], [], 0
            self.chunk_blocks = [] if self.chunk_blocks is not None else None

    def close(self) -> None:
        self._flush()
        self.writer.close()


class NpyWriter:
    """``OUT.npy`` (float32, rows in input order) and ``OUT.ids.txt`` beside it, both or neither: the
    ids file, renamed last, records the row count and sha256 of the ``.npy`` it belongs to."""

    def __init__(self, path: Path):
        self.path, self.ids_path = path, ids_path_for(path)
        self.tmp = self.ids_tmp = None
        self.tmp = new_temp(path.parent, path.name)
        self.ids_tmp = new_temp(path.parent, self.ids_path.name)
        self.fh = open(self.tmp, "r+b")
        self.fh.write(b"\0" * _NPY_HEADER)
        self.ids_fh = open(self.ids_tmp, "r+b")
        self.ids_fh.write(b" " * (_IDS_HEADER - 1) + b"\n")
        self.rows, self.dim = 0, None

    def write(self, ids: list[str], digests, block: np.ndarray) -> None:
        self.dim = block.shape[1]
        self.fh.write(np.ascontiguousarray(block, dtype="<f4").tobytes())
        self.ids_fh.write("".join(i + "\n" for i in ids).encode("utf-8"))
        self.rows += len(block)

    def finish(self, dim: int, summary: dict | None = None) -> None:
        """Finish both files and rename them into place, the ids file last (call with signals held off)."""
        header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }" % (self.rows, dim)
        header = header.ljust(_NPY_HEADER - 10 - 1) + "\n"
        self.fh.seek(0)
        self.fh.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1"))
        self.fh.close()
        record = f"#dice_fast-ids rows={self.rows} vectors_sha256={file_sha256(self.tmp, fsync=True)}"
        self.ids_fh.seek(0)
        self.ids_fh.write(record.ljust(_IDS_HEADER - 1).encode("ascii") + b"\n")
        self.ids_fh.flush()
        os.fsync(self.ids_fh.fileno())
        self.ids_fh.close()
        os.replace(self.tmp, self.path)
        self.tmp = None
        fsync_dir(self.path.parent)
        os.replace(self.ids_tmp, self.ids_path)  # the commit point
        self.ids_tmp = None
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        for fh in (getattr(self, "fh", None), getattr(self, "ids_fh", None)):
            if fh is not None:
                with contextlib.suppress(OSError):
                    fh.close()
        for tmp in (self.tmp, self.ids_tmp):
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        self.tmp = self.ids_tmp = None


def _discard_stream(writer) -> None:
    """Close ``writer``'s open Parquet stream and delete its temporary file, if any (abort paths)."""
    if writer.stream is not None:
        with contextlib.suppress(Exception):
            writer.stream.writer.close()
        writer.stream = None
    if writer.tmp is not None:
        with contextlib.suppress(OSError):
            writer.tmp.unlink()
        writer.tmp = None


class ParquetFileWriter:
    """One ``OUT.parquet`` with columns ``id`` and ``embedding``, renamed into place when complete."""

    def __init__(self, path: Path, metadata: dict, chunks: bool = False):
        self.path, self.metadata, self.chunks = path, metadata, chunks
        self.tmp = new_temp(path.parent, path.name)
        self.stream = None
        self.rows = 0

    def write(self, ids: list[str], digests, block: np.ndarray, chunks: ChunkRows | None = None) -> None:
        if self.stream is None:
            self.stream = _ParquetStream(self.tmp, block.shape[1], self.metadata, self.chunks)
        self.stream.write(ids, block, chunks)
        self.rows += len(block)

    def finish(self, dim: int, summary: dict | None = None) -> None:
        """Close the file and rename it into place (call with signals held off)."""
        if self.stream is None:
            self.stream = _ParquetStream(self.tmp, dim, self.metadata, self.chunks)
        self.stream.close()
        self.stream = None
        _fsync_and_hash(self.tmp)
        os.replace(self.tmp, self.path)
        self.tmp = None
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        _discard_stream(self)


class ShardWriter:
    """A folder of Parquet shards of ``shard_rows`` rows and a manifest, committed shard by shard.

    manifest: the job's description (options, input, split); ``shards`` lists what is committed
    (carried over from the manifest of an interrupted run on resume). ``guard``: a context manager
    factory holding off SIGINT/SIGTERM while a commit renames files. ``replace``: the files of an
    output being replaced (``--overwrite``), kept until `finish`; the shards wait in ``staged``.
    """

    def __init__(self, folder: Path, tag: str, shard_rows: int, manifest: dict, guard=contextlib.nullcontext,
                 chunks: bool = False, replace: list[Path] | None = None):
        self.folder, self.tag, self.shard_rows, self.guard, self.chunks = folder, tag, shard_rows, guard, chunks
        self.replace, self.staged = replace, []
        self.run = f"-{secrets.token_hex(4)}" if replace is not None else ""  # names the old output cannot hold
        self.manifest = manifest
        self.manifest.setdefault("shards", [])
        self.tmp = self.stream = None
        self.rows = 0
        self.first_id = self.last_id = None
        self.input_hash = hashlib.sha256()

    @property
    def committed_rows(self) -> int:
        return sum(s["rows"] for s in self.manifest["shards"])

    def write(self, ids: list[str], digests: list[bytes], block: np.ndarray, chunks: ChunkRows | None = None) -> None:
        from .resume import update_input_hash

        start = 0
        while start < len(block):
            if self.stream is None:
                self.tmp = new_temp(self.folder, shard_name(self.tag, len(self.manifest["shards"]), self.run))
                meta = {k: v for k, v in self.manifest.items() if k not in ("shards", "rows", "status", "summary")}
                meta["shard"] = len(self.manifest["shards"])
                self.stream = _ParquetStream(self.tmp, block.shape[1], meta, self.chunks)
                self.first_id = ids[start]
            take = min(self.shard_rows - self.rows, len(block) - start)
            self.stream.write(ids[start : start + take], block[start : start + take],
                              chunks[start : start + take] if chunks is not None else None)
            for i in range(start, start + take):
                update_input_hash(self.input_hash, ids[i], digests[i])
            self.rows += take
            self.last_id = ids[start + take - 1]
            start += take
            if self.rows == self.shard_rows:
                self.commit_shard()

    def commit_shard(self) -> None:
        """Close the open shard, rename it into place and list it in the manifest."""
        if self.stream is None:
            return
        self.stream.close()
        self.stream = None
        size, digest = _fsync_and_hash(self.tmp)
        name = shard_name(self.tag, len(self.manifest["shards"]), self.run)
        entry = {"file": name, "rows": self.rows, "first_id": self.first_id, "last_id": self.last_id,
                 "bytes": size, "sha256": digest, "input_sha256": self.input_hash.hexdigest()}
        with self.guard():
            if self.replace is None:
                os.replace(self.tmp, self.folder / name)
                fsync_dir(self.folder)
            else:
                self.staged.append((self.tmp, name))
            self.tmp = None
            self.manifest["shards"].append(entry)
            if self.replace is None:
                self.write_manifest()
        self.rows, self.input_hash = 0, hashlib.sha256()

    def write_manifest(self, status: str = "running") -> None:
        self.manifest["status"] = status
        self.manifest["rows"] = self.committed_rows
        replace_file(self.folder / manifest_name(self.tag), json.dumps(self.manifest, indent=1) + "\n")

    def finish(self, dim: int, summary: dict | None = None) -> None:
        """Commit the last (short) shard and mark the manifest complete."""
        self.commit_shard()
        self.manifest["summary"] = summary or {}
        with self.guard():
            for i, (tmp, name) in enumerate(self.staged):  # beside the old output's files, under names it does not use
                os.replace(tmp, self.folder / name)
                self.staged[i] = (self.folder / name, name)  # where `abort` removes it until the commit
            fsync_dir(self.folder)
            mine = manifest_name(self.tag)
            # the old output's manifests of another split layout, by name and sha256 (a later manifest of
            # that name is another): readers skip them from the commit on
            replaced = {p.name: file_sha256(p) for p in sorted(self.replace or ())
                        if p.name.startswith("manifest") and p.name != mine and p.exists()}
            if replaced:
                self.manifest["replaces"] = replaced
            self.write_manifest("complete")  # the commit point
            self.staged = []
            kept = {mine} | {s["file"] for s in self.manifest["shards"]}
            for p in self.replace or ():
                if p.name not in kept:
                    p.unlink(missing_ok=True)
            fsync_dir(self.folder)

    def abort(self) -> None:
        _discard_stream(self)
        for tmp, _ in self.staged:
            tmp.unlink(missing_ok=True)
        self.staged = []


def ids_path_for(npy: Path) -> Path:
    """``OUT.ids.txt`` beside ``OUT.npy``."""
    return npy.with_name(npy.name[: -len(".npy")] + ".ids.txt")


def parse_tag(name: str) -> tuple[int, int] | None:
    """The split ``(index, count)`` a file name of ours carries, ``None`` for an unsplit job's file."""
    m = re.match(r"^\.?(?:manifest|part)-(\d+)of(\d+)[-.]", name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def file_temps(path: Path) -> list[Path]:
    """The temporary files `new_temp` made for ``path`` beside it (``.NAME.XXXXXXXX.tmp``): a killed
    run's, to remove once the output's lock is held."""
    pattern = re.compile(rf"^\.{re.escape(temp_stem(path.name))}\.[0-9a-f]{{8}}\.tmp$")
    return sorted(p for p in path.parent.iterdir() if pattern.match(p.name)) if path.parent.is_dir() else []


def our_files(folder: Path) -> list[Path]:
    """Shard, manifest and temporary files of ours in ``folder``."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _OUR_TEMPS.match(p.name) or _OUR_FILES.match(p.name))


