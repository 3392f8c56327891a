"""SIGINT and SIGTERM during a job: stop reading, raise `Interrupted` in the main thread (held off while
a commit renames files), and warnings as one line each."""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; raised in the main thread (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class Signals:
    """SIGINT/SIGTERM handlers for the job's lifetime: set ``stop`` (the reader thread stops) and
    raise `Interrupted`, unless inside `critical`, which delays the raise to its end."""

    def __init__(self, stop: threading.Event):
        self.stop, self.depth, self.pending, self.saved = stop, 0, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.stop.is_set():
            return  # already stopping: a second signal does not interrupt the clean-up
        self.stop.set()
        if self.depth:
            self.pending = signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None:
                signum, self.pending = self.pending, None
                raise Interrupted(signum)


@contextlib.contextmanager
def one_line_warnings():
    """Warnings (e.g. a query cut to the model window) as one ``dice-fast: warning:`` line each."""
    import sys

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"dice-fast: warning: {' '.join(str(message).split())}", file=file or sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
