"""``dice-fast serve`` as its own process with the bundled model: the flags reach the limits, and SIGTERM
stops accepting, finishes the requests in flight with correct vectors, then exits.

The drain is proved, not hoped for: the server runs with a gate in its model (a forward pre-hook that
holds every forward while a gate file exists). The test closes the gate, sends requests, sees them all
accepted and one forward held at the gate, sends SIGTERM, sees the server stop taking requests, and
only then opens the gate: every request was in flight when the signal landed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dice_fast.data import prose
from helpers import assert_close
from serve_testing import embeddings_of, metric, wait_until

# `dice-fast serve` with a gate in the model's forward (paths in the environment): while GATE exists,
# every forward first touches HELD, then waits for GATE to go. A warm-up forward passes: the test
# creates GATE only once /health says ready.
GATED_SERVE = """
import os, sys, time
import dice_fast.cliargs as cliargs

gate, held = os.environ["DICE_FAST_TEST_GATE"], os.environ["DICE_FAST_TEST_HELD"]
make = cliargs.make_encoder

def gated(args):
    enc = make(args)

    def hold(module, inputs):
        if os.environ.get("DICE_FAST_TEST_FAIL"):
            raise RuntimeError("injected forward failure")
        if os.path.exists(gate):
            open(held, "a").close()
            while os.path.exists(gate):
                time.sleep(0.01)

    enc.model.register_forward_pre_hook(hold)
    return enc

cliargs.make_encoder = gated
from dice_fast.cli import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_finishes_requests_in_flight_then_exits(real_encoder, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gate, held = tmp_path / "gate", tmp_path / "held"
    cmd = [sys.executable, "-c", GATED_SERVE, "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-batch-tokens", "512", "--max-inputs-per-request", "1", "--graceful-timeout", "120",
           "--served-model-name", "minilm", "--no-access-log", "--device", "cpu", "--dtype", "float32"]
    env = {**os.environ, "DICE_FAST_TEST_GATE": str(gate), "DICE_FAST_TEST_HELD": str(held)}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    words = prose().split()
    texts = [" ".join(words[i * 1000 : i * 1000 + 950]) for i in range(4)]  # ~1200 tokens each
    try:
        def status(path):
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(url + path, timeout=5).status_code
            except httpx.TransportError:
                return None

        wait_until(lambda: status("/health") == 200, timeout=180, what="dice-fast serve to be ready")
        print(f"server ready after {time.monotonic() - started:.1f} s")
        too_many = httpx.post(url + "/v1/embeddings", json={"input": texts[:2]}, timeout=30)
        assert too_many.status_code == 413 and "limit is 1" in too_many.json()["error"]["message"]

        gate.touch()  # from here every forward waits at the gate
        with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=url, timeout=180) as http:
            futures = [pool.submit(http.post, "/v1/embeddings", json={"input": [texts[i]]}) for i in range(4)]

            def all_accepted_and_held():
                running = metric(http.get("/metrics").text, "dice_fast_requests_in_flight")
                return running == 4 and held.exists()

            wait_until(all_accepted_and_held, timeout=60, what="4 requests in flight, a forward held at the gate")
            proc.send_signal(signal.SIGTERM)
            # draining: /health stops answering 200 (503, or the socket closed), and so do new requests
            wait_until(lambda: status("/health") != 200, timeout=60, what="the server to start draining")
            try:
                late = httpx.post(url + "/v1/embeddings", json={"input": ["late"]}, timeout=5).status_code
            except httpx.TransportError:
                late = None
            assert late in (None, 503), late
            assert not any(f.done() for f in futures)  # all four still in flight when the signal landed
            gate.unlink()  # let the held forwards run
            responses = [f.result(timeout=180) for f in futures]
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    print(f"exited after {time.monotonic() - started:.1f} s")
    log = proc.stdout.read()
    assert code == 0, log  # a drain that finished is a clean exit (uvicorn raised the signal again: 143)
    assert "Finished server process" in log, log
    ref = real_encoder.encode_documents(texts)
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "minilm"
        assert_close(embeddings_of(r.json()), ref[i : i + 1], atol=1e-5, what=f"request {i}")


def _serve(tmp_path, *flags, fail=False):
    """`dice-fast serve` (the bundled model) in its own process, gated as above; (process, url, gate, held)."""
    port = free_port()
    gate, held = tmp_path / "gate", tmp_path / "held"
    env = {**os.environ, "DICE_FAST_TEST_GATE": str(gate), "DICE_FAST_TEST_HELD": str(held)}
    if fail:
        env["DICE_FAST_TEST_FAIL"] = "1"
    cmd = [sys.executable, "-c", GATED_SERVE, "serve", "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
           "--device", "cpu", "--dtype", "float32", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc, f"http://127.0.0.1:{port}", gate, held


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_failed_warm_up_exits_with_status_3_for_a_supervisor(tmp_path):
    """It stayed up for good, unhealthy (503 to every request), with nothing to restart it."""
    proc, url, _, _ = _serve(tmp_path, fail=True)
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = proc.stdout.read()
    assert code == 3, log
    assert "the encoder is unhealthy (the worker stopped (RuntimeError: injected forward failure))" in log, log
    assert "dice-fast serve: error: the encoder stopped" in log, log


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_with_a_forward_that_never_ends_exits_cleanly_within_the_graceful_timeouts(tmp_path):
    """Ctrl-C with a forward held for good: the request gets 503 after --graceful-timeout, the forward is
    waited for as long again, then left; exit status 0 with no error line (the shutdown waited for the
    worker without bound, and a clean Ctrl-C was reported as an error with status 2)."""
    proc, url, gate, held = _serve(tmp_path, "--graceful-timeout", "1")
    try:
        wait_until(lambda: proc.poll() is None and _ready(url), timeout=180, what="dice-fast serve to be ready")
        gate.touch()  # never opened: the forward stays held
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=url, timeout=60) as http:
            pending = pool.submit(http.post, "/v1/embeddings", json={"input": ["held for good"]})
            wait_until(held.exists, timeout=60, what="a forward held at the gate")
            proc.send_signal(signal.SIGINT)
            signalled = time.monotonic()
            assert pending.result(timeout=30).status_code == 503
            code = proc.wait(timeout=30)
        took = time.monotonic() - signalled
    finally:
        gate.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = proc.stdout.read()
    assert code == 0 and "dice-fast: error" not in log and "Traceback" not in log, log
    assert "the worker was still in a forward after 1.0 s" in log, log
    assert took < 15, (took, log)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
