"""Calibration chunks for static int8: the user's own text, else the first half of the bundled prose.

Calibration runs the chunks the engine will run: windows of ``chunk_size`` tokens of the text,
wrapped with the encoder's special tokens and document prefix, local positions. Never a hub.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import InputError, MissingFile

CALIBRATION_CHUNKS = 300  # as many as the OpenVINO static int8 peer calibrated on
MAX_BYTES = 1 << 20  # of a calibration file read: ~240k MiniLM tokens of prose (0.8 s to tokenize), 3x what 300 chunks take
SLICES = 16  # a larger file is read as this many evenly spaced slices of MAX_BYTES / SLICES
# the least calibration text, in chunks' worth of tokens: activation ranges set on less are set on too little
# (MiniLM calibrated on two words: cos min 0.67 against float32; on ~8 chunks of prose 0.989; the bundled prose 0.995)
MIN_CHUNKS = 8


def calibration_text(path: str | os.PathLike | None) -> str:
    """The calibration text: the UTF-8 file at ``path`` (a sample of the user's corpus), else the
    first half of the bundled prose (`dice_fast.data.prose_halves`; the second half is held out).

    A file over `MAX_BYTES` is read as `SLICES` evenly spaced slices of it (cut between characters,
    joined by blank lines), so a whole corpus may be passed: the sample spans it, and reading and
    tokenizing it stay bounded (~1 s). InputError naming the file for a missing or unreadable file,
    bytes that are not UTF-8 (with their offset) or a file without text."""
    if path is None:
        from ..data import prose_halves

        return "\n\n".join(prose_halves()[0])
    path = os.fspath(path)
    p = Path(path)
    if not p.exists():
        raise MissingFile(f"calibration: {path!r} does not exist (a UTF-8 text sample of your corpus)")
    if not p.is_file():
        raise InputError(f"calibration: {path!r} is not a file (a UTF-8 text sample of your corpus)")
    try:
        pieces = _read_spans(p, path)
    except OSError as exc:  # permission denied, an I/O error
        raise InputError(f"calibration: cannot read {path!r} ({exc.strerror or exc})") from None
    text = "\n\n".join(pieces)
    if not text.strip():
        raise InputError(f"calibration: {path!r} holds no text")
    return text


def _read_spans(p: Path, path: str) -> list[str]:
    """The text of ``p`` (whole within `MAX_BYTES`, else `SLICES` evenly spaced slices), decoded as UTF-8."""
    size = p.stat().st_size
    width = MAX_BYTES // SLICES
    spans = [(0, size)] if size <= MAX_BYTES else [((size - width) * k // (SLICES - 1), width) for k in range(SLICES)]
    pieces = []
    with open(p, "rb") as fh:
        for start, length in spans:
            fh.seek(start)
            raw = fh.read(length)
            first, end = _whole_characters(raw, cut_head=start > 0, cut_tail=start + length < size)
            try:
                pieces.append(raw[first:end].decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise InputError(f"calibration: {path!r} is not UTF-8 text ({exc.reason} at byte "
                                 f"{start + first + exc.start})") from None
    return pieces


def _whole_characters(raw: bytes, cut_head: bool, cut_tail: bool) -> tuple[int, int]:
    """The byte range [first, end) of ``raw``, a slice of UTF-8 text, without the character the
    slice cut at its head (if ``cut_head``: its continuation bytes, 0b10xxxxxx) or its tail (if
    ``cut_tail``: a last character shorter than its lead byte says)."""
    first = 0
    while cut_head and first < min(3, len(raw)) and raw[first] & 0xC0 == 0x80:
        first += 1
    end = lead = len(raw)
    if cut_tail and raw:
        lead -= 1
        while lead > max(end - 4, first) and raw[lead] & 0xC0 == 0x80:
            lead -= 1
        length = 1 if raw[lead] < 0x80 else 2 if raw[lead] < 0xE0 else 3 if raw[lead] < 0xF0 else 4
        end = lead if end - lead < length else end
    return first, max(first, end)


def calibration_chunks(tokenizer, text: str, chunk_size: int, prefix: np.ndarray, suffix: np.ndarray,
                       first_position: int, n: int = CALIBRATION_CHUNKS,
                       source: str = "the calibration text") -> list[tuple[np.ndarray, np.ndarray]]:
    """Up to ``n`` wrapped chunks of ``text``: [(ids, positions)], each (1, L) int64 with
    L = len(prefix) + chunk_size + len(suffix). Windows start at an even stride over the text, at
    least a quarter chunk apart (so a short text gives fewer chunks, each token in at most about four
    of them; the first half of the bundled prose gives 300 of 254 tokens). InputError naming
    ``source`` (the file) for a text shorter than `MIN_CHUNKS` chunks."""
    ids = np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], np.int64)
    if len(ids) < MIN_CHUNKS * chunk_size:
        raise InputError(f"calibration: {source} gives {len(ids)} tokens; int8 calibrates on at least "
                         f"{MIN_CHUNKS * chunk_size} ({MIN_CHUNKS} chunks of {chunk_size}): activation ranges set "
                         "on less text lose retrieval (two words: cos min 0.67 against float32). Pass a "
                         "longer sample of your corpus, or none for the bundled prose")
    size = chunk_size
    n = max(1, min(n, -(-(len(ids) - size) // max(size // 4, 1)) + 1))
    starts = np.unique(np.linspace(0, len(ids) - size, n).round().astype(np.int64))
    out = []
    for s in starts:
        row = np.concatenate([prefix, ids[s : s + size], suffix]).astype(np.int64)[None, :]
        out.append((row, (first_position + np.arange(row.shape[1], dtype=np.int64))[None, :]))
    return out
