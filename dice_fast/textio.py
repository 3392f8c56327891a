"""Reading line-oriented text inputs with errors that name the file and line."""

from __future__ import annotations

import json
import os
from typing import Iterator


def read_lines(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """Yield ("file:line", line without its line break); ValueError on bytes that are not UTF-8."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
            yield where, line.rstrip("\n").rstrip("\r")


def read_json_objects(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yield ("file:line", object) for every non-blank line of a JSON-lines file.

    ValueError naming the file and line for invalid UTF-8, malformed JSON or a value that is not an object.
    """
    for where, line in read_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record
