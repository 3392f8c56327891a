"""Duplicate ids in a corpus job, found as they stream past in 8 bytes per document (`dice_fast.id_set`).

    dup = DuplicateIds()
    dup.add(["a", "b", "a"])      # ids that occurred earlier, counted: dup.count, dup.examples, dup.message()
"""

from __future__ import annotations

from ..id_set import IdSet


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
