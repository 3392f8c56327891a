"""The queries of an encode job (``--queries``): encoded in blocks of `BATCH` (one window each), and
those cut to the model window named once for the job, by id (per block, they were numbered within it)."""

from __future__ import annotations

import warnings
from itertools import islice

from ..chunking import TruncatedWarning, truncated_message

BATCH = 256


class QueryBlocks:
    """Iterate: (n, dim) float32 blocks of ``texts`` encoded by ``enc``. After each block, `note` its ids;
    at the end, `warn` once for the queries cut to the model window."""

    def __init__(self, enc, texts, progress):
        self.enc, self.texts, self.progress = enc, texts, progress
        self._cut: list[TruncatedWarning] = []  # of the block just yielded
        self._truncated: list[tuple[str, int]] = []  # (id, tokens) of the first three queries cut
        self._n_truncated = 0  # (a count, not a list: a job of passages as queries cuts nearly every row)
        self._sizes: tuple[int, int] | None = None  # (tokens kept, model window)

    def __iter__(self):
        while batch := list(islice(self.texts, BATCH)):
            cut = []
            with warnings.catch_warnings():  # only TruncatedWarning is taken; the others show as ever
                shown = warnings.showwarning
                warnings.simplefilter("always", TruncatedWarning)  # the same text in two blocks: two

                def show(message, category, filename, lineno, file=None, line=None):
                    if issubclass(category, TruncatedWarning):
                        cut.append(message)
                    else:
                        shown(message, category, filename, lineno, file, line)

                warnings.showwarning = show
                block = self.enc.encode_queries(batch, progress=self.progress)
            self._cut = cut
            yield block

    def note(self, ids: list[str]) -> None:
        """The ids of the block just yielded, in order."""
        for w in self._cut:
            self._truncated += [(ids[p], int(n)) for p, n in zip(w.positions[:3], w.lengths[:3])]
            del self._truncated[3:]
            self._n_truncated += len(w.positions)
            self._sizes = (w.capacity, w.window)

    def warn(self) -> None:
        """One `TruncatedWarning` naming the first three queries cut, by id; none when none was."""
        if self._truncated:
            names = [f"id {i!r} ({n} tokens)" for i, n in self._truncated[:3]]
            message = truncated_message(names, self._n_truncated, *self._sizes, "queries")
            warnings.warn(TruncatedWarning(message, capacity=self._sizes[0], window=self._sizes[1]), stacklevel=2)
