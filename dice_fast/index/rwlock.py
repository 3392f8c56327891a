"""A readers-writer lock: `DiceIndex` searches run side by side, a write runs alone.

Searches only read the index (numpy releases the GIL in their matrix products, so they overlap);
an add, upsert or delete replaces several arrays and the id list one after another, and a search
between two of those steps would pair one document's id with another's vectors. A waiting writer
holds back readers that arrive after it, so a stream of searches cannot starve a write.

Not reentrant: a thread holding either side must not take the lock again.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class ReadWriteLock:
    """``with lock.reading():`` shared with other readers; ``with lock.writing():`` exclusive."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0  # threads inside reading()
        self._writing = False  # a thread inside writing()
        self._waiting_writers = 0

    @contextmanager
    def reading(self):
        with self._cond:
            while self._writing or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def writing(self):
        with self._cond:
            self._waiting_writers += 1
            try:
                while self._writing or self._readers:
                    self._cond.wait()
            finally:
                self._waiting_writers -= 1
                self._cond.notify_all()  # readers held back by this writer (gone if interrupted)
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
