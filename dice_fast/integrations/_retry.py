"""When the server client tries a request again, and how long it waits: 429 (queue full), 503 (starting
or stopping) and connection failures are retried, with bounded attempts and bounded total time,
honouring the server's ``Retry-After`` and spreading clients apart with jitter.

    policy = RetryPolicy(max_retries=3, max_retry_seconds=60.0)
    attempt = policy.start()
    while (wait := attempt.wait_after(status, error)) is not None: sleep(wait); ...

No HTTP client imported here: ``status`` is an int (None for a transport error), ``retry_after`` the
header's text.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from dataclasses import dataclass, field

from ..config import checked_integer

RETRY_STATUSES = (429, 503)
MAX_WAIT_S = 30.0  # one wait, whatever Retry-After says


def retry_after_seconds(value: str | None) -> float | None:
    """``Retry-After`` as seconds from now: a number of seconds or an HTTP date; None if absent, unreadable,
    negative or not finite ("nan", "inf": the client then waits its own backoff)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return None if when is None else max(when.timestamp() - time.time(), 0.0)


@dataclass(frozen=True)
class RetryPolicy:
    """max_retries: tries after the first (0: never retry); max_retry_seconds: no retry starts once this
    long has passed since the first try began, nor one whose wait would end after it; backoff_s: the
    first wait without ``Retry-After`` (doubling per retry, up to `MAX_WAIT_S`), drawn in [w/2, w]."""

    max_retries: int = 3
    max_retry_seconds: float = 60.0
    backoff_s: float = 0.5
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "max_retries", checked_integer("max_retries", self.max_retries, minimum=0))
        for name in ("max_retry_seconds", "backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")

    def start(self) -> "Attempts":
        return Attempts(self, time.monotonic())


@dataclass
class Attempts:
    """The tries of one request under a `RetryPolicy`."""

    policy: RetryPolicy
    started: float
    made: int = 0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def wait_after(self, status: int | None, retry_after: str | None = None) -> float | None:
        """Seconds to wait before the next try after one answered ``status`` (None: no response, a
        connection error), or None: stop here (success, an error retrying cannot fix, or tries or time spent)."""
        self.made += 1
        p = self.policy
        if status is not None and status not in RETRY_STATUSES or self.made > p.max_retries:
            return None
        told = retry_after_seconds(retry_after)
        step = min(MAX_WAIT_S, p.backoff_s * 2 ** (self.made - 1))
        wait = p.rng.uniform(step / 2, step)
        if told is not None:  # at least what the server asked, a little more so clients told alike spread out
            wait = min(told, MAX_WAIT_S) + p.rng.uniform(0, min(step, 1.0) / 2)
        if self.elapsed + wait > p.max_retry_seconds:
            return None
        return wait
