"""A progress bar that counts tokens (its ETA is in tokens) and shows documents beside them; shared
by the engine and every command. And `print_done`, a finished job's last line."""

from __future__ import annotations

import contextlib
import sys
import time


LINE_SECONDS = 30.0  # where stderr is no terminal: a progress line this often


class ProgressBar:
    """A tqdm bar over tokens that also shows documents and tokens/s; call it with increments.

    total_tokens: the tokens to run, when known (then the bar has an ETA). ``tokens`` and
    ``documents`` count what was reported so far, also when the bar is hidden (``show=False``).
    Where stderr is no terminal (a log file, a batch job) a line every ``line_seconds`` replaces the
    bar: a bar redrawn ten times a second made one ever-growing line of a log.
    """

    def __init__(self, total_tokens: int | None = None, desc: str | None = None, show: bool = True,
                 line_seconds: float = LINE_SECONDS):
        from tqdm.auto import tqdm

        self.lines = show and sys.stderr is not None and not _live_display(tqdm)
        self.bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, dynamic_ncols=True, desc=desc,
                        disable=not show or self.lines)
        self.tokens, self.documents, self.t0 = 0, 0, time.perf_counter()
        self.desc, self.line_seconds, self.lines_printed = desc or "progress", line_seconds, 0
        self.next_line = line_seconds  # seconds since the start

    def __call__(self, documents: int, tokens: int) -> None:
        self.tokens += tokens
        self.documents += documents
        self.bar.set_postfix_str(f"{self.documents:,} docs", refresh=False)
        self.bar.update(tokens)
        if self.lines and self.seconds >= self.next_line:
            self._line()

    def _line(self) -> None:
        seconds = self.seconds
        rate = self.tokens / seconds if seconds > 0 else 0.0
        total = self.bar.total
        part = f" of ~{total:,} ({100 * self.tokens / total:.0f} %)" if total else ""
        left = f", ~{_clock((total - self.tokens) / rate)} left" if total and rate and total > self.tokens else ""
        try:
            print(f"{self.desc}: {self.tokens:,} tokens{part}, {self.documents:,} docs, {rate:,.0f} tok/s, "
                  f"{_clock(seconds)}{left}", file=sys.stderr, flush=True)
        except (OSError, ValueError, AttributeError):  # stderr closed or gone: progress is not worth the job
            self.lines = False
            return
        self.lines_printed += 1
        self.next_line = seconds + self.line_seconds  # after a long batch: one line, not a burst

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def close(self) -> None:
        if self.lines and self.lines_printed:  # the log says where it ended
            self._line()
        self.bar.close()


def _live_display(tqdm_class) -> bool:
    """Whether a redrawn bar shows as one: stderr is a terminal, or a notebook's (tqdm's widget, or its
    text bar where ipywidgets is missing)."""
    if any(c.__module__ == "tqdm.notebook" for c in tqdm_class.__mro__) or type(sys.stderr).__module__.startswith(
            "ipykernel"):
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@contextlib.contextmanager
def progress_reporter(show: bool, callback, total_tokens):
    """The caller's callback, else a `ProgressBar` of ``total_tokens`` (closed on exit) when ``show``,
    else None: what an encode call reports its progress to."""
    if callback is not None or not show:
        yield callback
        return
    bar = ProgressBar(total_tokens)
    try:
        yield bar
    finally:
        bar.close()


def print_done(line: str) -> None:
    """Print a finished job's summary ``line`` on stdout. Its output is committed by then, so a stdout that
    cannot take the line (a full disk, characters its encoding lacks, as a path's undecodable bytes)
    costs a warning on stderr, never the job's status (it exited 2, "error", and a retry was refused:
    the output existed). A closed pipe still ends the command as a pipe does (status 141)."""
    try:
        try:
            print(line, flush=True)
        except UnicodeEncodeError:
            encoding = sys.stdout.encoding or "utf-8"
            print(line.encode(encoding, "backslashreplace").decode(encoding), flush=True)
    except BrokenPipeError:
        raise
    except OSError as exc:
        print(f"dice-fast: warning: done, but stdout could not take the summary ({exc.strerror or exc})",
              file=sys.stderr)
