"""Reading input as a stream: windows of whole documents cut from any iterable, and a one-item
read-ahead in a worker thread (so the next window is tokenized while the model runs this one)."""

from __future__ import annotations

import concurrent.futures
from typing import Iterator
from .errors import ArgumentTypeError


def as_iterator(texts, what: str) -> Iterator:
    if isinstance(texts, (str, bytes)):
        raise ArgumentTypeError(f"{what} must be an iterable of strings, not a single {type(texts).__name__}")
    try:
        return iter(texts)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be an iterable of strings, got {type(texts).__name__}") from None


def windows(texts: Iterator, max_chars: int, max_documents: int) -> Iterator[tuple[list[str], int]]:
    """Consecutive windows of whole documents (``max_chars`` characters or ``max_documents``
    documents), each with the index of its first document; every element is checked to be a str."""
    base, window, chars = 0, [], 0
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ArgumentTypeError(f"documents[{i}] is {type(text).__name__}, expected str")
        window.append(text)
        chars += len(text)
        if chars >= max_chars or len(window) >= max_documents:
            yield window, base
            base, window, chars = base + len(window), [], 0
    if window or base == 0:
        yield window, base


class Prefetch:
    """Prepare the next item of an iterator in a worker thread while the caller works on the current one.

    The iterator itself is advanced in the caller's thread (an iterable tied to its thread, such as a
    sqlite3 cursor, works; a paused input never holds the worker), ``prepare(item)`` runs in the worker,
    but for the first item, which the caller waits for anyway: it is prepared in the caller's thread,
    so a one-item input (one query) starts no thread (~0.1 ms a call).
    An error of the iterator or of ``prepare`` is raised by the `next` call whose item it would have
    been, not earlier."""

    def __init__(self, items: Iterator, prepare=None):
        self.items = items
        self.prepare = prepare or (lambda item: item)
        self.pool = None  # the worker, started with the second item
        self.future = self._submit(here=True)

    def _submit(self, here: bool = False):
        done = concurrent.futures.Future()
        try:
            item = next(self.items, _END)
            if item is _END:
                return None
            if here:
                done.set_result(self.prepare(item))
                return done
        except Exception as exc:  # noqa: BLE001 - raised when its turn comes
            done.set_exception(exc)
            return done
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dice_fast-prefetch")
        return self.pool.submit(self.prepare, item)

    def next(self):
        """The next prepared item, or None at the end."""
        if self.future is None:
            return None
        item = self.future.result()
        self.future = self._submit()
        return item

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.future is not None:
            self.future.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)  # at most one `prepare` still running


_END = object()
