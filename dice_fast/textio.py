"""Reading line-oriented text inputs, and the text and id of a JSON record, with errors that name the file and line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from .errors import InputError

COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz"}  # a line file's last suffix: read decompressed


def compression(path: str | os.PathLike) -> str | None:
    """The compression a line file's name says (its last suffix, one of `COMPRESSIONS`), else None."""
    return COMPRESSIONS.get(Path(path).suffix.lower())


def format_suffix(path: str | os.PathLike) -> str:
    """The extension that names a file's format, lower case, before a compression's: ".jsonl" for
    "a.JSONL.gz"; "" for none."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def file_lines(path: str | os.PathLike) -> Iterator[tuple[bytes, int]]:
    """Each line of the file ``path`` (its line break kept) and the bytes of the file it took: decompressed
    where the name ends in .gz, .bz2 or .xz, and then the compressed bytes read for it (so they add up to
    the file's size). `InputError` naming the file and the line after which its compressed data is damaged
    or cut short."""
    import bz2
    import gzip
    import lzma
    import zlib

    kind = compression(path)
    with open(path, "rb") as raw:
        if kind is None:
            for line in raw:
                yield line, len(line)
            return
        number, taken = 0, 0
        opener = {"gzip": lambda f: gzip.GzipFile(fileobj=f), "bzip2": bz2.BZ2File, "xz": lzma.LZMAFile}[kind]
        try:
            with opener(raw) as lines:
                for line in lines:
                    number += 1
                    read = raw.tell()
                    yield line, read - taken
                    taken = read
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
            raise InputError(f"{path}: after line {number}: its {kind} data is damaged or cut short ({exc})") from None


def decode_line(raw: bytes, where: str, first: bool = False) -> str:
    """``raw`` as text without its line break (and, for a file's ``first`` line, without a UTF-8 byte
    order mark, which editors on Windows write); ValueError naming ``where`` ("file:line") if not UTF-8."""
    try:
        line = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return line.rstrip("\n").rstrip("\r")


def parse_json_object(line: str, where: str) -> dict:
    """The JSON object on ``line``; ValueError naming ``where`` for malformed JSON or a non-object."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise InputError(f"{where}: malformed JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise InputError(f"{where}: unreadable JSON ({str(exc).split(';')[0]})") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def check_unicode(value: str, where: str, what: str) -> str:
    """``value``; InputError naming ``where`` and ``what`` if it is not valid Unicode (a lone surrogate,
    which JSON's ``\\ud800`` escapes can make but no UTF-8 file can hold)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{where}: {what} is not valid Unicode: a lone surrogate "
                         f"(\\u{ord(value[exc.start]):04x}) at character {exc.start}") from None
    return value


def record_text(record: dict, field: str, where: str, unicode: bool = True) -> str:
    """The text in ``field`` of a JSON ``record``; InputError naming ``where`` if the field is missing, not
    a string or (``unicode``: checked) not valid Unicode."""
    if field not in record:
        raise InputError(f"{where}: no field {field!r} (fields: {', '.join(map(str, record)) or 'none'})")
    text = record[field]
    if not isinstance(text, str):
        raise InputError(f"{where}: field {field!r} is {type(text).__name__}, expected a string")
    return check_unicode(text, where, f"field {field!r}") if unicode else text


def record_id(record: dict, id_field: str, where: str, unicode: bool = True) -> str:
    """The id in ``id_field`` of a JSON ``record`` as a string (see `check_id`); InputError naming
    ``where`` if the field is missing or (``unicode``: checked) the id is not valid Unicode."""
    if id_field not in record:
        raise InputError(f"{where}: no id field {id_field!r} (fields: {', '.join(map(str, record)) or 'none'})")
    doc_id = check_id(record[id_field], where)
    return check_unicode(doc_id, where, f"id field {id_field!r}") if unicode else doc_id


def check_id(value, where: str) -> str:
    """An id value (a string or an integer, not a bool) as a string without line breaks; InputError
    naming ``where`` otherwise (a null, a float, a list ... is never turned into an id)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"{where}: id {value!r} is {type(value).__name__}, expected a string or an integer")
    value = str(value)
    if "\n" in value or "\r" in value:
        raise InputError(f"{where}: id {value!r} contains a line break")
    return value


def no_id_field_in_lines(what: str, id_field: str, ids: str = "line numbers") -> InputError:
    """The error for ``--id-field`` given with text lines (a .txt file, stdin as txt), which have no
    fields, so an id would be made up: ``what`` names the input ("input a.txt is a .txt file"), ``ids``
    what its ids are without ``--id-field``."""
    return InputError(f"{what} (one text per line, no fields), so --id-field {id_field!r} cannot apply; its ids "
                      f"are {ids} without --id-field, or give JSON lines")


def read_lines(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """Yield ("file:line", line without its line break) of a line file (decompressed: `file_lines`);
    ValueError on bytes that are not UTF-8."""
    for number, (raw, _) in enumerate(file_lines(path), start=1):
        where = f"{path}:{number}"
        yield where, decode_line(raw, where, first=number == 1)


def read_json_objects(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yield ("file:line", object) for every non-blank line of a JSON-lines file.

    ValueError naming the file and line for invalid UTF-8, malformed JSON or a value that is not an object.
    """
    for where, line in read_lines(path):
        if not line.strip():
            continue
        yield where, parse_json_object(line, where)
