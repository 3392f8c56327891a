"""A progress bar that counts tokens (its ETA is in tokens) and shows documents beside them; shared
by the engine and every command."""

from __future__ import annotations

import contextlib
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
