"""Duplicate ids in a corpus job, found as they stream past in 8 bytes per document.

    seen = IdSet()
    seen.add(["a", "b", "a"])     # -> ["a"]: ids seen before (earlier blocks or this one)
    dup = DuplicateIds()
    dup.add(["a", "b", "a"])      # the same, counted: dup.count, dup.examples, dup.message()

Each id is kept as its 64-bit Python string hash (SipHash, keyed per process; the job only
compares ids within one process, resumed shards included) in sorted runs, each more than twice the
size of the next, so there are at most log2(n) of them: a block is looked up with one binary search
per run, and runs are merged (a linear merge of two sorted arrays) like a binary counter. O(n log n)
over a corpus, 8 bytes per distinct id (10 million: 80 MB), no Python object per id. Two different
ids share a hash with probability about n^2 / 2^65: 3e-6 at 10 million ids, 3e-4 at 100 million,
3 % at a billion; such a pair would be reported as a duplicate (the job's warning names it, and the
ids can be checked).
"""

from __future__ import annotations

import numpy as np


class IdSet:
    """The ids of a stream so far; `add` returns those seen before."""

    def __init__(self):
        self._runs: list[np.ndarray] = []  # sorted, pairwise disjoint, each over twice the next one's size
        self.count = 0  # distinct ids held

    def add(self, ids: list[str]) -> list[str]:
        """Record ``ids`` (in stream order); return the ones already recorded, each time it recurs."""
        if not ids:
            return []
        h = np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids))
        seen = np.zeros(len(ids), dtype=bool)
        for run in self._runs:
            pos = np.searchsorted(run, h).clip(max=len(run) - 1)
            seen |= run[pos] == h
        fresh, first = np.unique(h[~seen], return_index=True)
        repeat = ~seen
        repeat[np.flatnonzero(~seen)[first]] = False  # first occurrence within the block
        seen |= repeat
        if len(fresh):
            self._runs.append(fresh)
            self.count += len(fresh)
            while len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1]):
                top = self._runs.pop()  # disjoint from every run (fresh ids only); timsort merges two runs
                self._runs[-1] = np.sort(np.concatenate([self._runs[-1], top]), kind="stable")
        return [ids[i] for i in np.flatnonzero(seen)]


class DuplicateIds:
    """Documents whose id occurred earlier in the job's input: a count and the first few ids."""

    SHOWN = 5

    def __init__(self):
        self.seen, self.count, self.examples, self.more = IdSet(), 0, [], False

    def add(self, ids: list[str]) -> None:
        """Record the next ``ids`` of the input, counting those that occurred before."""
        again = self.seen.add(ids)
        self.count += len(again)
        new = [i for i in dict.fromkeys(again) if i not in self.examples]
        room = self.SHOWN - len(self.examples)
        self.examples += new[:room]
        self.more = self.more or len(new) > room  # a repeated id beyond the ones shown

    def message(self) -> str:
        shown = ", ".join(repr(i) for i in self.examples) + (", ..." if self.more else "")
        return (f"{self.count:,} document{'s have an id' if self.count > 1 else ' has an id'} that occurred "
                f"earlier in the input ({shown}); every document still has its own row")
