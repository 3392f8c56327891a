"""Arrays that appends extend in amortised linear time: `DiceIndex`'s vectors and spans.

Concatenating on every append copies the whole array each time, so building an index batch by batch
was quadratic. A `Grown` array keeps a buffer that doubles when full; the array seen (`Grown.view`,
what a `Column` attribute reads) is the filled part. An append writes past the filled part (or into
a new buffer), so an array read before an append or a `Grown.compress` never changes under its reader.
"""

from __future__ import annotations

import numpy as np

# `DiceIndex`'s grown arrays (each a `Column`), in the order an index folder saves them
COLUMNS = ("documents", "chunks", "cu_doc_chunks", "chunk_start_char", "chunk_end_char", "chunk_tokens")

# `Grown.compress` copies runs of kept rows one by one while they are few (at most _MIN_RUNS, or one per
# _RUN_BYTES of array: a copy each, not a gather into a temporary and a copy); more: one boolean gather
_MIN_RUNS, _RUN_BYTES = 64, 1 << 16

class Grown:
    """``view``: the first ``size`` rows of ``buffer``. An array given whole (e.g. memory-mapped from
    a file) is its own full buffer: the first append copies it into memory, with room to grow."""

    __slots__ = ("buffer", "size")

    def __init__(self, array: np.ndarray, capacity: int = 0):
        self.size = len(array)
        if capacity > self.size:
            self.buffer = np.empty((capacity, *array.shape[1:]), array.dtype)
            self.buffer[: self.size] = array
        else:
            self.buffer = array

    @property
    def view(self) -> np.ndarray:
        return self.buffer[: self.size]

    def append(self, rows: np.ndarray) -> None:
        """Write ``rows`` after the filled part (cast to the buffer's dtype), doubling the buffer when full."""
        if not len(rows):  # nothing to write (a read-only memory-mapped buffer stays as it is)
            return
        need = self.size + len(rows)
        if need > len(self.buffer) or not self.buffer.flags.writeable:
            self.buffer = Grown(self.view, max(need, 2 * len(self.buffer))).buffer
        self.buffer[self.size : need] = rows
        self.size = need

    def compress(self, keep: np.ndarray) -> Grown:
        """A new `Grown` of the rows where ``keep`` (bool, one per row), with this one's capacity (so
        that appends after a delete do not grow it again); this one is left as it was."""
        out = Grown(self.buffer[:0], len(self.buffer))
        edges = np.flatnonzero(np.diff(keep, prepend=False, append=False)).tolist()  # run starts, ends
        if len(edges) // 2 > max(_MIN_RUNS, self.view.nbytes // _RUN_BYTES):
            out.append(self.view[keep])  # many short runs: one gather (a temporary) rather than a copy per run
        else:
            for start, end in zip(edges[::2], edges[1::2]):  # one copy of each run of kept rows
                out.append(self.view[start:end])
        return out


class Column:
    """A class attribute that reads as the filled part of its `Grown` (kept in the instance's
    ``__dict__`` under the same name; `grown` returns it); assigning an array makes it the column's
    whole content, assigning a `Grown` installs it."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        return self if instance is None else vars(instance)[self.name].view

    def __set__(self, instance, array) -> None:
        vars(instance)[self.name] = array if isinstance(array, Grown) else Grown(array)


def grown(instance, name: str) -> Grown:
    """The `Grown` behind ``instance``'s `Column` ``name`` (to append to)."""
    return vars(instance)[name]
