"""Calibration chunks for static int8: the user's own text, else the first half of the bundled prose.

Calibration runs the chunks the engine will run: windows of ``chunk_size`` tokens of the text,
wrapped with the encoder's special tokens and document prefix, local positions. Never a hub.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import InputError

CALIBRATION_CHUNKS = 300  # as many as the OpenVINO static int8 peer calibrated on


def calibration_text(path: str | None) -> str:
    """The calibration text: the UTF-8 file at ``path`` (a sample of the user's corpus), else the
    first half of the bundled prose (`dice_fast.data.prose_halves`; the second half is held out)."""
    if path is None:
        from ..data import prose_halves

        return "\n\n".join(prose_halves()[0])
    p = Path(path)
    if not p.is_file():
        raise InputError(f"calibration: {path!r} is not a file (a UTF-8 text sample of your corpus)")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise InputError(f"calibration: {path!r} holds no text")
    return text


def calibration_chunks(tokenizer, text: str, chunk_size: int, prefix: np.ndarray, suffix: np.ndarray,
                       first_position: int, n: int = CALIBRATION_CHUNKS) -> list[tuple[np.ndarray, np.ndarray]]:
    """Up to ``n`` wrapped chunks of ``text``: [(ids, positions)], each (1, L) int64 with
    L = len(prefix) + min(chunk_size, text tokens) + len(suffix). Windows start at an even stride
    over the text, at least a quarter chunk apart (so a short text gives fewer chunks, each token
    in at most about four of them; the first half of the bundled prose gives 300 of 254 tokens)."""
    ids = np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], np.int64)
    if len(ids) == 0:
        raise InputError("calibration text has no tokens")
    size = min(chunk_size, len(ids))
    n = max(1, min(n, -(-(len(ids) - size) // max(size // 4, 1)) + 1))
    starts = np.unique(np.linspace(0, len(ids) - size, n).round().astype(np.int64))
    out = []
    for s in starts:
        row = np.concatenate([prefix, ids[s : s + size], suffix]).astype(np.int64)[None, :]
        out.append((row, (first_position + np.arange(row.shape[1], dtype=np.int64))[None, :]))
    return out
