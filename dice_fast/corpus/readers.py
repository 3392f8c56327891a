"""Reading a corpus as a stream of ``(id, text)`` records: a file, a folder of files, or stdin.

Formats (by extension, or ``fmt`` for every file and for stdin):

* ``.txt``: one document per line; the id is the line number (1-based).
* ``.jsonl`` / ``.ndjson``: one JSON object per line, the text in ``text_field``; the id is the value
  of ``id_field`` (a string or an integer) when given, else the line number.
* ``.txt`` and ``.jsonl`` / ``.ndjson`` compressed: ``.gz``, ``.bz2`` or ``.xz`` after the extension
  (``corpus.jsonl.gz``), read decompressed as a stream (`dice_fast.textio.file_lines`).
* ``.parquet``: the text in column ``text_field`` (strings, string views, or a dictionary of strings);
  the id in column ``id_field`` (strings, UTF-8 bytes, integers, or a dictionary of those) when given,
  else the row number (1-based, like line numbers). Read in record batches, never whole.

Blank lines (empty or only whitespace) are skipped in ``.txt`` and ``.jsonl`` alike and counted in
``Corpus.blank_lines``; line numbers, and so the ids, still count them, so an id always points at its
line. An empty string in a JSON field or a Parquet column is an (empty) document, not a blank line.

In a folder, every file with a known extension is read (recursively, hidden files and folders
skipped, sorted by relative path) except the outputs of ``dice-fast encode`` (`is_encode_output`);
line- and row-number ids then carry the file's relative path: ``"sub/a.txt:12"``. Ids are strings
everywhere. A malformed line raises `InputError` (a ValueError) naming ``file:line``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import InputError, MissingFile, OptionError, reading_parquet
from ..textio import (check_id, compression, decode_line, file_lines, format_suffix, no_id_field_in_lines,
                      parse_json_object, record_id, record_text)
from .outputs import IDS_RECORD

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
KNOWN = ("known input types: .txt (one document per line), .jsonl/.ndjson (JSON lines), either compressed "
         "(.gz, .bz2, .xz after it), .parquet, a folder of them, or - (stdin, with --format)")
_PARQUET_BATCH = 1024


class Stopped(Exception):
    """Reading stopped because ``Corpus.stop`` was set (the job is being interrupted)."""


def input_format(path: str | os.PathLike, fmt: str = "auto") -> str:
    """The format of one input file: ``fmt`` unless "auto", else from the extension (`OptionError` /
    `InputError` if unknown)."""
    if fmt != "auto":
        if fmt not in FORMATS.values():
            raise OptionError(f"unknown input format {fmt!r}; allowed: auto, txt, jsonl, parquet")
        return fmt
    suffix = _known_suffix(path)
    if suffix is None:
        raise InputError(f"{path}: unknown input type {''.join(Path(path).suffixes[-2:]) or '(no extension)'!r}; "
                         f"{KNOWN}; or name the format of this file with --format txt, jsonl or parquet")
    return FORMATS[suffix]


def _known_suffix(path) -> str | None:
    """The key of `FORMATS` a file's name gives (".jsonl" for a.jsonl.gz), None for none (a compressed
    Parquet file among them: Parquet compresses inside)."""
    suffix = format_suffix(path)
    return suffix if suffix in FORMATS and not (suffix == ".parquet" and compression(path)) else None


@dataclass
class Corpus:
    """An input opened for streaming. ``records()`` yields ``(id, text)``; the counters describe what
    it read so far (``bytes_read`` is updated as records are read, from any thread)."""

    source: str
    fmt: str = "auto"
    text_field: str = "text"
    id_field: str | None = None
    files: list[tuple[str, Path, str]] = field(default_factory=list)  # (name in ids, path, format)
    stdin: bool = False
    blank_lines: int = 0
    bytes_read: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def total_bytes(self) -> int | None:
        """Bytes of all input files (``None`` for stdin)."""
        return None if self.stdin else sum(p.stat().st_size for _, p, _ in self.files)

    def fingerprint(self) -> dict:
        """What identifies this input: each file's name (relative to the input) and size in bytes."""
        if self.stdin:
            return {"stdin": True}
        return {"files": [{"name": name or Path(self.source).name, "size": p.stat().st_size, "format": f}
                          for name, p, f in self.files]}

    def records(self) -> Iterator[tuple[str, str]]:
        """``(id, text)`` of every document, in order; `InputError` naming ``file:line`` on bad input."""
        if self.stdin:
            yield from self._lines("<stdin>", None, self.fmt, ((raw, len(raw)) for raw in _stdin_lines(self.stop)))
            return
        for name, path, fmt in self.files:
            if fmt == "parquet":
                yield from self._parquet(name, path)
            else:
                yield from self._lines(str(path), name, fmt, file_lines(path))

    # -----------------------------------------------------------------------------------------
    def _lines(self, where: str, name: str | None, fmt: str, lines: Iterator[tuple[bytes, int]]):
        """Records of ``lines``: (a line, the input bytes it took)."""
        field_, id_field = self.text_field, self.id_field
        for number, (raw, taken) in enumerate(lines, start=1):
            if self.stop.is_set():
                raise Stopped("reading stopped")
            self.bytes_read += taken
            line = decode_line(raw, f"{where}:{number}", first=number == 1)
            if not line.strip():
                self.blank_lines += 1
                continue
            line_id = str(number) if name is None else f"{name}:{number}"
            if fmt == "txt":
                yield line_id, line
                continue
            at = f"{where}:{number}"
            record = parse_json_object(line, at)
            escaped = "\\u" in line  # only a \u escape can make a lone surrogate (not valid Unicode)
            text = record_text(record, field_, at, unicode=escaped)
            if id_field is None:
                yield line_id, text
                continue
            doc_id = record_id(record, id_field, at, unicode=escaped)
            yield doc_id, text

    def _parquet(self, name: str | None, path: Path):
        import pyarrow as pa

        pf = _open_parquet(path, self.text_field, self.id_field)
        columns = list(dict.fromkeys([self.text_field] + ([self.id_field] if self.id_field is not None else [])))
        size, total_rows, row = path.stat().st_size, max(pf.metadata.num_rows, 1), 0
        for batch in _batches(pf, path, columns, lambda: row):
            if self.stop.is_set():
                raise Stopped("reading stopped")
            texts = batch.column(0)
            if pa.types.is_dictionary(texts.type):  # a categorical column: its strings
                texts = texts.cast(texts.type.value_type)
            if texts.null_count:
                bad = row + 1 + texts.is_null().to_pylist().index(True)
                raise InputError(f"{path}: row {bad}: column {self.text_field!r} is null")
            texts = _pylist(texts, path, row, f"column {self.text_field!r}")
            if self.id_field is None:
                ids = [str(r) if name is None else f"{name}:{r}" for r in range(row + 1, row + 1 + len(texts))]
            else:
                col = batch.column(columns.index(self.id_field))  # 0 where the id is the text
                if col.null_count:
                    bad = row + 1 + col.is_null().to_pylist().index(True)
                    raise InputError(f"{path}: row {bad}: id column {self.id_field!r} is null")
                if not _is_string(col.type):
                    try:
                        col = col.cast(pa.string())
                    except pa.ArrowInvalid:  # bytes that are not UTF-8
                        bad = row + 1 + next(i for i, v in enumerate(col.to_pylist()) if not _is_utf8(v))
                        raise InputError(f"{path}: row {bad}: id column {self.id_field!r} is not valid UTF-8") from None
                ids = [check_id(v, f"{path}: row {row + 1 + i}")
                       for i, v in enumerate(_pylist(col, path, row, f"id column {self.id_field!r}"))]
            row += len(texts)
            self.bytes_read += size * len(texts) // total_rows
            yield from zip(ids, texts)


def open_corpus(source: str, fmt: str = "auto", text_field: str = "text", id_field: str | None = None,
                exclude: Iterable[str | os.PathLike] = ()) -> Corpus:
    """Open ``source`` (a file, a folder of files, or ``"-"`` for stdin) and check what can be
    checked before reading: it exists, its type is known, Parquet columns exist. ``exclude``: paths
    (files, or folders with all they hold) never read from a folder (the job's own output); nor is
    any other output of ``dice-fast encode`` found there (`is_encode_output`)."""
    corpus = Corpus(source, fmt, text_field, id_field)
    if source == "-":
        if fmt == "auto":
            raise OptionError("reading stdin (-) needs --format txt or --format jsonl")
        if fmt == "parquet":
            raise OptionError("Parquet cannot be read from stdin; pass the file or folder")
        input_format("-", fmt)
        if fmt == "txt" and id_field is not None:
            raise no_id_field_in_lines("stdin read as .txt", id_field)
        corpus.stdin = True
        return corpus
    path = Path(source)
    if not path.exists():
        link = f" (a broken symbolic link to {os.readlink(path)})" if path.is_symlink() else ""
        raise MissingFile(f"input {source} does not exist{link}")
    if path.is_dir():
        skip = {Path(e).resolve() for e in exclude}
        wanted = set(FORMATS) if fmt == "auto" else {s for s, f in FORMATS.items() if f == input_format(path, fmt)}
        for p in sorted(_walk(path), key=lambda p: p.relative_to(path).as_posix()):
            inside_output = not skip.isdisjoint([p.resolve(), *p.resolve().parents])
            suffix = _known_suffix(p)
            if suffix in wanted and not inside_output and not is_encode_output(p, text_field):
                name = p.relative_to(path).as_posix()
                try:
                    name.encode("utf-8")
                except UnicodeEncodeError:  # ids are made of it, and ids are UTF-8 in every output
                    raise InputError(f"input {p!r}: its file name is not valid UTF-8, and its ids would carry it; "
                                     "rename the file") from None
                corpus.files.append((name, p, FORMATS[suffix]))
        if not corpus.files:
            kinds = ", ".join(sorted(wanted))
            raise InputError(f"input folder {source} holds no {kinds} files; {KNOWN}")
    else:
        corpus.files.append((None, path, input_format(path, fmt)))
    for _, p, f in corpus.files:
        if p.is_symlink() and not p.exists():
            raise MissingFile(f"input {p} is a broken symbolic link (to {os.readlink(p)})")
        if f == "parquet":
            _open_parquet(p, text_field, id_field)
        elif not os.access(p, os.R_OK):
            raise PermissionError(f"input {p} is not readable")
        elif f == "txt" and id_field is not None:  # a line has no fields: its id would be made up
            raise no_id_field_in_lines(f"input {p} is a .txt file", id_field, "FILE:LINE")
    return corpus


def read_documents(path: str, fmt: str = "auto", field: str = "text") -> list[str]:
    """The texts of every document of ``path`` as a list (see `open_corpus`; blank lines skipped)."""
    return [text for _, text in open_corpus(path, fmt, field).records()]


# ---------------------------------------------------------------------------------------------
def is_encode_output(path: Path, text_field: str = "text") -> bool:
    """Whether ``path`` was written by ``dice-fast encode``: an ids file (``.ids.txt`` whose first line
    is `IDS_RECORD`) or a Parquet file with the ``dice_fast`` metadata key (a shard or ``.parquet``) and
    no ``text_field`` column (one read back and given texts keeps the metadata: it is input)."""
    import pyarrow.parquet as pq

    name = path.name.lower()
    with contextlib.suppress(OSError, ValueError):
        if name.endswith(".ids.txt"):
            with open(path, "rb") as fh:
                return bool(IDS_RECORD.match(fh.readline(256).decode("ascii").rstrip("\r\n")))
        if name.endswith(".parquet"):
            schema = pq.read_schema(path)
            return b"dice_fast" in (schema.metadata or {}) and text_field not in schema.names
    return False  # unreadable: left to the reader, which names the file


def _walk(root: Path) -> Iterator[Path]:
    def unreadable(exc: OSError):  # a folder that cannot be listed would silently lose its documents
        raise InputError(f"input folder {exc.filename} cannot be read ({exc.strerror})")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            if not f.startswith("."):
                yield Path(dirpath) / f


def _open_parquet(path: Path, text_field: str, id_field: str | None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with reading_parquet(path):
        pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    for column, what in ((text_field, "text"), (id_field, "id")):
        if column is not None and column not in names:
            raise InputError(f"{path}: no {what} column {column!r} (columns: {', '.join(names)})")
        if column is not None and names.count(column) > 1:
            raise InputError(f"{path}: {names.count(column)} columns are named {column!r}; which is the {what} is "
                             "ambiguous")
    kind = pf.schema_arrow.field(text_field).type
    if not _is_string(kind.value_type if pa.types.is_dictionary(kind) else kind):
        raise InputError(f"{path}: column {text_field!r} is {kind}, expected strings")
    if id_field is not None:
        kind = pf.schema_arrow.field(id_field).type
        value = kind.value_type if pa.types.is_dictionary(kind) else kind
        if not (_is_string(value) or pa.types.is_binary(value) or pa.types.is_large_binary(value)
                or pa.types.is_integer(value)):
            raise InputError(f"{path}: id column {id_field!r} is {kind}, expected strings or integers")
    return pf


def _batches(pf, path: Path, columns: list[str], rows_read) -> Iterator:
    """``pf``'s record batches; InputError naming ``path`` and the rows of the first row group that cannot
    be read or decoded (a damaged file whose footer is intact), searched from row ``rows_read()`` + 1."""
    import pyarrow as pa

    batches = pf.iter_batches(batch_size=_PARQUET_BATCH, columns=columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            first, why = rows_read() + 1, " ".join(str(exc).split())
            where = f"row {first}: cannot read the rows from here on"
            start = 0
            for group in range(pf.metadata.num_row_groups):  # a batch spans row groups: find the damaged one
                end = start + pf.metadata.row_group(group).num_rows
                if end >= first:
                    try:
                        pf.read_row_group(group, columns=columns)
                    except (pa.ArrowException, OSError) as again:
                        where = f"row {max(start + 1, first)}: cannot read row group {group} (rows {start + 1}-{end})"
                        why = " ".join(str(again).split())
                        break
                start = end
            raise InputError(f"{path}: {where}, the file is damaged ({why})") from None
        yield batch


def _pylist(column, path: Path, row: int, what: str) -> list:
    """``column``'s values as Python objects; InputError naming the row (``row`` + 1 + index) of the first
    string that is not valid UTF-8 (Parquet files written by other tools may hold such bytes)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError:
                raise InputError(f"{path}: row {row + 1 + i}: {what} is not valid UTF-8") from None
        raise


def _is_string(kind) -> bool:
    import pyarrow as pa

    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _stdin_lines(stop: threading.Event) -> Iterator[bytes]:
    """Lines of stdin, read by a daemon thread so that a consumer waiting for input can still stop."""
    lines: queue.Queue = queue.Queue(maxsize=4096)
    stream = sys.stdin.buffer

    def pump():
        try:
            for raw in stream:
                lines.put(raw)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            lines.put(exc)
        lines.put(None)

    threading.Thread(target=pump, name="dice_fast-stdin", daemon=True).start()
    while True:
        try:
            item = lines.get(timeout=0.1)
        except queue.Empty:
            if stop.is_set():
                raise Stopped("reading stopped") from None
            continue
        if item is None:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


class ReadProgress:
    """The engine's progress callback: counts tokens on the bar and sets its total (so its ETA) from
    the input's size in bytes and the tokens per byte of the documents encoded so far (no total for
    stdin). ``offsets`` receives, per document read, the input's byte offset just after it."""

    def __init__(self, bar, corpus: Corpus):
        self.bar, self.corpus = bar, corpus
        self.total_bytes = corpus.total_bytes
        self.base = self.done_bytes = corpus.bytes_read
        self.offsets: deque = deque()

    def __call__(self, documents: int, tokens: int) -> None:
        for _ in range(min(documents, len(self.offsets))):
            self.done_bytes = self.offsets.popleft()
        read = self.done_bytes - self.base
        done = self.bar.tokens + tokens
        if self.total_bytes and read > 0 and done > 0:
            self.bar.bar.total = max(int(done * (self.total_bytes - self.base) / read), done)
        self.bar(documents, tokens)
