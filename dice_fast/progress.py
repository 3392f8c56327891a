"""A progress bar that counts tokens (its ETA is in tokens) and shows documents beside them; shared
by the engine and every command. And `print_done`, a finished job's last line."""

from __future__ import annotations

import contextlib
import sys
import time


class ProgressBar:
    """A tqdm bar over tokens that also shows documents and tokens/s; call it with increments.

    total_tokens: the tokens to run, when known (then the bar has an ETA). ``tokens`` and
    ``documents`` count what was reported so far, also when the bar is hidden (``show=False``).
    """

    def __init__(self, total_tokens: int | None = None, desc: str | None = None, show: bool = True):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, dynamic_ncols=True, desc=desc,
                        disable=not show)
        self.tokens, self.documents, self.t0 = 0, 0, time.perf_counter()

    def __call__(self, documents: int, tokens: int) -> None:
        self.tokens += tokens
        self.documents += documents
        self.bar.set_postfix_str(f"{self.documents:,} docs", refresh=False)
        self.bar.update(tokens)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def close(self) -> None:
        self.bar.close()


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
