"""Helpers of the serving tests: a real uvicorn server on a loopback port in a thread, an encoder
proxy whose forwards can be held back or made to fail, and text generators."""

from __future__ import annotations

import base64
import random
import socket
import threading
import time

import numpy as np

from tiny_models import WORDS


class ServerThread:
    """``with ServerThread(app) as s: httpx.get(s.url + "/health")``: uvicorn serving ``app`` on
    127.0.0.1 at a free port, in a daemon thread, as ``dice-fast serve`` runs it (``bounds``: the
    `dice_fast.serve.server.SERVER_LIMITS` to change); leaving the block shuts it down gracefully."""

    def __init__(self, app, graceful_timeout: float = 20.0, **bounds):
        import uvicorn

        from dice_fast.serve.server import SERVER_DEFAULTS, bounded_protocol, server_config

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        bounds = {**SERVER_DEFAULTS, **bounds}
        self.protocol = bounded_protocol(bounds["read_timeout"], bounds["write_timeout"])  # .bytes_received
        config = server_config(app, host="127.0.0.1", port=self.port, protocol=self.protocol, log_level="warning",
                               lifespan="on", access_log=False, timeout_graceful_shutdown=graceful_timeout, **bounds)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout: float = 30.0) -> ServerThread:
        """Wait until ``/health`` answers 200: the worker's warm-up forward is done (before it, 503)."""
        import httpx

        wait_until(lambda: httpx.get(self.url + "/health").status_code == 200, timeout, what="the warm-up")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not shut down within 30 s"


class ProxyEncoder:
    """A `DiceEncoder` whose ``run_batch`` records every batch, waits while ``gate`` is clear, and
    raises for the next ``fail`` batches; everything else is the wrapped encoder's."""

    def __init__(self, inner, fail: int = 0):
        self._inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.running = threading.Event()  # set when a batch has started (and is held by the gate)
        self.batches: list[int] = []  # tokens per batch run
        self.fail = fail

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def run_batch(self, packed):
        self.running.set()
        if not self.gate.wait(60):
            raise RuntimeError("test gate never opened")
        if self.fail:
            self.fail -= 1
            raise RuntimeError("injected model failure")
        self.batches.append(packed.n_tokens)
        return self._inner.run_batch(packed)


def word_texts(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """``n`` texts of ``lo``..``hi`` words of the tiny models' vocabulary (one token per word there)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def embeddings_of(body: dict) -> np.ndarray:
    """(n, dim) float32 from an OpenAI-shaped response, float or base64, checking the indices."""
    data = body["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    assert all(d["object"] == "embedding" for d in data)
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") if isinstance(d["embedding"], str)
            else np.asarray(d["embedding"], dtype=np.float32) for d in data]
    return np.stack(rows)


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def metric(text: str, name: str, **labels) -> float:
    """The value of sample ``name{labels}`` in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{want}}}" if want else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
