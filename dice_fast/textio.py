"""Reading line-oriented text inputs with errors that name the file and line."""

from __future__ import annotations

import json
import os
from typing import Iterator
from .errors import InputError


def decode_line(raw: bytes, where: str) -> str:
    """``raw`` as text without its line break; ValueError naming ``where`` ("file:line") if not UTF-8."""
    try:
        line = raw.decode("utf-8")
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


def read_lines(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """Yield ("file:line", line without its line break); ValueError on bytes that are not UTF-8."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            where = f"{path}:{number}"
            yield where, decode_line(raw, where)


def read_json_objects(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yield ("file:line", object) for every non-blank line of a JSON-lines file.

    ValueError naming the file and line for invalid UTF-8, malformed JSON or a value that is not an object.
    """
    for where, line in read_lines(path):
        if not line.strip():
            continue
        yield where, parse_json_object(line, where)
