"""`TextColumn`: an index's document texts as one UTF-8 blob and byte offsets, so that reading one hit's
passage reads one document (a memory-mapped blob is paged in piece by piece), never all of them.

    column = TextColumn.from_texts(["a text", "another"])
    column[1]          # "another"; len(column), iteration, extend(texts) as for a list
    blob, offsets = column.arrays()   # (n_bytes,) uint8 and (n + 1,) int64, as saved
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..errors import ArgumentTypeError, InputError


class TextColumn(Sequence):
    """Texts 0..n-1 stored as ``blob[offsets[i]:offsets[i+1]]`` (UTF-8) plus texts appended since."""

    def __init__(self, blob: np.ndarray, offsets: np.ndarray):
        offsets = np.asarray(offsets, np.int64)
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(blob) \
                or np.any(np.diff(offsets) < 0):
            raise InputError(f"text offsets must rise from 0 to the blob's {len(blob)} bytes")
        self._blob, self._offsets = blob, offsets
        self._added: list[str] = []

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> TextColumn:
        column = cls(np.zeros(0, np.uint8), np.zeros(1, np.int64))
        column.extend(texts)
        return column

    def __len__(self) -> int:
        return len(self._offsets) - 1 + len(self._added)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"text {i} of {n}")
        i = i % n
        stored = len(self._offsets) - 1
        if i >= stored:
            return self._added[i - stored]
        return bytes(self._blob[self._offsets[i] : self._offsets[i + 1]]).decode("utf-8")

    def extend(self, texts: Iterable[str]) -> None:
        texts = list(texts)
        bad = next((j for j, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise ArgumentTypeError(f"texts[{bad}] is a {type(texts[bad]).__name__}, not a string")
        self._added.extend(texts)

    def take(self, keep: np.ndarray) -> TextColumn:
        """A new column of the texts at positions ``keep`` (int array), in that order: their bytes copied
        run by run of consecutive positions (a delete keeps a few long runs), never decoded."""
        keep = np.asarray(keep, np.int64)
        blob, offsets = self.arrays()
        sizes = offsets[keep + 1] - offsets[keep]
        new_offsets = np.zeros(len(keep) + 1, np.int64)
        np.cumsum(sizes, out=new_offsets[1:])
        runs = np.split(keep, np.flatnonzero(np.diff(keep) != 1) + 1) if len(keep) else []
        parts = [np.asarray(blob[offsets[r[0]] : offsets[r[-1] + 1]], np.uint8) for r in runs]
        return TextColumn(np.concatenate(parts) if parts else np.zeros(0, np.uint8), new_offsets)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(blob uint8, offsets int64 (n + 1,)) of every text, the appended ones included."""
        if not self._added:
            return np.asarray(self._blob, np.uint8), self._offsets
        encoded = [t.encode("utf-8") for t in self._added]
        extra = np.frombuffer(b"".join(encoded), np.uint8)
        sizes = np.cumsum([len(e) for e in encoded], dtype=np.int64) + self._offsets[-1]
        return np.concatenate([np.asarray(self._blob, np.uint8), extra]), np.concatenate([self._offsets, sizes])

    def __eq__(self, other) -> bool:
        if isinstance(other, (TextColumn, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"TextColumn({len(self)} texts)"
