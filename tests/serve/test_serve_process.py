"""``dice-fast serve`` as its own process with the bundled model: the flags reach the limits, and SIGTERM
stops accepting, finishes the requests in flight with correct vectors, then exits."""

from __future__ import annotations

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_finishes_requests_in_flight_then_exits(real_encoder):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "dice_fast.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-batch-tokens", "512", "--max-inputs-per-request", "1", "--graceful-timeout", "120",
           "--served-model-name", "minilm", "--no-access-log", "--device", "cpu", "--dtype", "float32"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    words = prose().split()
    # 4 requests of one ~1200-token document: ~10 forwards of 512 tokens, about a second on a quiet machine
    texts = [" ".join(words[i * 1000 : i * 1000 + 950]) for i in range(4)]
    try:
        def healthy():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout=180, what="dice-fast serve to start")
        print(f"server up after {time.monotonic() - started:.1f} s")
        too_many = httpx.post(url + "/v1/embeddings", json={"input": texts[:2]}, timeout=30)
        assert too_many.status_code == 413 and "limit is 1" in too_many.json()["error"]["message"]

        with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=url, timeout=180) as http:
            futures = [pool.submit(http.post, "/v1/embeddings", json={"input": [texts[i]]})
                       for i in range(4)]

            def all_accepted_some_running():
                m = http.get("/metrics").text
                running = metric(m, "dice_fast_requests_in_flight")
                return running > 0 and running + metric(m, "dice_fast_requests_total", input_type="document",
                                                        status="200") == 4

            wait_until(all_accepted_some_running, timeout=60, what="4 requests accepted, some still running")
            proc.send_signal(signal.SIGTERM)
            print(f"SIGTERM after {time.monotonic() - started:.1f} s")
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # no longer accepting
                httpx.post(url + "/v1/embeddings", json={"input": ["late"]}, timeout=5)
            responses = [f.result(timeout=180) for f in futures]
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    print(f"exited after {time.monotonic() - started:.1f} s")
    log = proc.stdout.read()
    assert code in (0, -signal.SIGTERM), log  # uvicorn re-raises the signal after a graceful exit
    assert "Finished server process" in log, log
    ref = real_encoder.encode_documents(texts)
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "minilm"
        assert_close(embeddings_of(r.json()), ref[i : i + 1], atol=1e-5, what=f"request {i}")
