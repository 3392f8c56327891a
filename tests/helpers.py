"""Assertion helpers shared by the tests: tolerances travel with dtype, NaN is always a failure; a lock
that counts (and can hold) its acquisitions."""

from __future__ import annotations

import threading

import numpy as np
import torch

# (atol, rtol) per input dtype of the op under test
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual, expected, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """Fail with the first mismatching entries; NaN or inf anywhere in ``actual`` is a failure."""
    a = actual.detach().cpu().double().numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual, np.float64)
    e = expected.detach().cpu().double().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what} shape {a.shape} != expected {e.shape}"
    if a.size == 0:
        return
    assert np.isfinite(a).all(), f"{what} has {int((~np.isfinite(a)).sum())} non-finite entries"
    err = np.abs(a - e)
    bad = err > atol + rtol * np.abs(e)
    if bad.any():
        idx = np.argwhere(bad)[:5]
        rows = ", ".join(f"{tuple(int(v) for v in i)}: got {a[tuple(i)]:.8g} want {e[tuple(i)]:.8g}" for i in idx)
        raise AssertionError(
            f"{what} mismatch in {int(bad.sum())}/{a.size} entries (max abs err {err.max():.3g}, "
            f"atol {atol}, rtol {rtol}); first: {rows}"
        )


class CountingLock:
    """A lock that counts its acquisitions and can hold the ``hold_at``-th one until ``release_hold`` is set."""

    def __init__(self, hold_at: int | None = None):
        self._lock = threading.Lock()
        self.acquired = 0
        self.hold_at = hold_at
        self.holding = threading.Event()
        self.release_hold = threading.Event()

    def __enter__(self):
        self._lock.acquire()
        self.acquired += 1
        if self.acquired == self.hold_at:
            self._lock.release()  # wait for the other thread without the lock, then take it again
            self.holding.set()
            assert self.release_hold.wait(60), "the other thread never finished"
            self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()


def kill_at_gate(argv: list[str], gate, env: dict, what: str, timeout: float = 100.0) -> str:
    """Start ``argv``, wait until it creates file ``gate`` (failing if it exits first or after ``timeout``
    seconds, naming ``what`` it never reached), SIGKILL it there; returns its stdout."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.monotonic()
    while not gate.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, f"the process never reached {what}"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    return proc.communicate(timeout=60)[0]


class CountingTokenizer:
    """A tokenizer that counts its calls; everything else is the wrapped one's."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def side_by_side(bodies, seconds: float) -> dict:
    """Run each of ``bodies`` (callables taking a `random.Random` of their own, seeded by position) in a
    loop in its own thread for ``seconds``, all at once; the first exception stops them all and is
    raised here. Returns {body's __name__: loops done} (bodies sharing a name add up)."""
    import random

    stop, errors, done = threading.Event(), [], [0] * len(bodies)

    def loop(body, seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                body(rng)
                done[seed] += 1
        except BaseException as exc:  # noqa: BLE001 - raised by the caller's thread
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=loop, args=(body, seed)) for seed, body in enumerate(bodies)]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    counts: dict = {}
    for body, n in zip(bodies, done):
        counts[body.__name__] = counts.get(body.__name__, 0) + n
    return counts
