"""A bounded attack on ``dice-fast serve`` (bundled model, 127.0.0.1 only): what a hostile client costs.

    python benchmarks/attack_serve.py                     # ~1-2 minutes on 2 cores; prints one line per probe

Probes (each bounded in requests, bytes and seconds):
  ratio       response bytes / request bytes of 2,048 one-letter inputs (float JSON; and with return_chunks)
  amplified   /health latency (max, p50) and server RSS growth while 16 clients send that request at once
              (targets: /health < 1 s, RSS growth < 256 MiB)
  unread      16 clients send it and never read: requests in flight and RSS, then after the write timeout
  gapless     latency of a small request sent beside a 2 MB body without whitespace ("a.a.a..."), and
              beside 2 MB of prose (target < 1 s)
  chunked     bytes a client could push in an oversize chunked upload before the server cut it (limit 2 MiB;
              an upper bound on what the server read: the kernel's socket buffers hold the rest)
  idle        of 256 connections that send nothing, how many are still open after the read timeout
The server runs with --read-timeout 3 --write-timeout 3 (the defaults are 30 s; the bounds are the same,
only sooner). Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

AMPLIFIED = json.dumps({"input": ["a"] * 2048}).encode()
TIMEOUT_S = 3.0


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Sampler:
    """Samples the server's RSS and /health latency every 50 ms in a thread while active."""

    def __init__(self, url: str, pid: int):
        self.url, self.pid, self.rss, self.health = url, pid, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import httpx

        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                self.rss.append(rss_mib(self.pid))
                t0 = time.perf_counter()
                http.get(self.url + "/health")
                self.health.append(time.perf_counter() - t0)
                self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)


def raw_post(port: int, body: bytes, read: bool = True, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def probe_ratio(http) -> dict:
    out = {}
    for name, body in (("float", AMPLIFIED),
                       ("return_chunks", json.dumps({"input": ["a"] * 2048, "return_chunks": True}).encode())):
        r = http.post("/v1/embeddings", content=body, headers={"Content-Type": "application/json"})
        out[name] = {"status": r.status_code, "request_bytes": len(body), "response_bytes": len(r.content),
                     "ratio": round(len(r.content) / len(body), 1), "seconds": round(r.elapsed.total_seconds(), 2)}
    return out


def probe_amplified(url: str, pid: int) -> dict:
    import httpx

    async def one(http):
        r = await http.post("/v1/embeddings", content=AMPLIFIED, headers={"Content-Type": "application/json"})
        return r.status_code

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=16)) as http:
            return await asyncio.gather(*(one(http) for _ in range(16)))

    before = rss_mib(pid)
    with Sampler(url, pid) as s:
        t0 = time.perf_counter()
        statuses = asyncio.run(asyncio.wait_for(main(), 300))
        seconds = time.perf_counter() - t0
    return {"statuses": sorted(set(statuses)), "seconds": round(seconds, 2),
            "health_max_s": round(max(s.health), 3), "health_p50_s": round(statistics.median(s.health), 3),
            "rss_before_mib": round(before), "rss_peak_mib": round(max(s.rss)),
            "rss_growth_mib": round(max(s.rss) - before)}


def probe_unread(url: str, port: int, pid: int, http) -> dict:
    before = rss_mib(pid)
    socks = [raw_post(port, AMPLIFIED, rcvbuf=4096) for _ in range(16)]
    time.sleep(TIMEOUT_S / 2)
    during = {"in_flight": http.get("/health").json()["requests_in_flight"], "rss_mib": round(rss_mib(pid))}
    time.sleep(TIMEOUT_S * 2 + 2)
    after = {"in_flight": http.get("/health").json()["requests_in_flight"], "rss_mib": round(rss_mib(pid))}
    for s in socks:
        s.close()
    return {"rss_before_mib": round(before), "during": during, "after_write_timeout": after}


def probe_gapless(http, port: int) -> dict:
    import httpx

    out = {}
    prose = ("The quick brown fox jumps over the lazy dog. " * 50_000)[:2_000_000]
    for name, text in (("gapless", "a." * 1_000_000), ("prose", prose)):
        big = json.dumps({"input": [text]}).encode()
        result = {}

        def send_big():
            with httpx.Client(timeout=120) as c:
                r = c.post(f"http://127.0.0.1:{port}/v1/embeddings", content=big,
                           headers={"Content-Type": "application/json"})
                result["big_status"], result["big_seconds"] = r.status_code, round(r.elapsed.total_seconds(), 2)

        t = threading.Thread(target=send_big)
        t.start()
        time.sleep(0.15)
        small = []
        for _ in range(5):
            t0 = time.perf_counter()
            http.post("/v1/embeddings", json={"input": ["a small request"]})
            small.append(time.perf_counter() - t0)
        t.join(120)
        out[name] = {"small_max_s": round(max(small), 3), "small_p50_s": round(statistics.median(small), 3), **result}
    return out


def probe_chunked(port: int, limit: int) -> dict:
    piece = 1 << 16
    chunk = b"%x\r\n%s\r\n" % (piece, b" " * piece)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    sent, t0 = 0, time.perf_counter()
    try:
        while sent < 64 * limit and time.perf_counter() - t0 < 30:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    reply = b""
    try:
        reply = sock.recv(200)
    except OSError:
        pass
    sock.close()
    return {"limit": limit, "client_sent_bytes": sent, "ratio_to_limit": round(sent / limit, 2),
            "status": reply[:12].decode("latin-1")}


def probe_idle(port: int) -> dict:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(256)]
    time.sleep(TIMEOUT_S + 1.5)
    open_ = 0
    for s in socks:
        s.setblocking(False)
        try:
            open_ += s.recv(1) != b""
        except BlockingIOError:
            open_ += 1  # nothing to read and not closed
        except OSError:
            pass
        s.close()
    return {"opened": 256, "open_after_timeout": open_, "timeout_s": TIMEOUT_S}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args()
    import httpx

    from dice_fast.serve.bench import wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="dice-fast-attack-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "dice_fast.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--no-access-log", "--log-level", "warning", "--device", "cpu", "--dtype", "float32",
           "--read-timeout", str(TIMEOUT_S), "--write-timeout", str(TIMEOUT_S)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    results = {}
    try:
        wait_healthy(url, lambda: None if proc.poll() is None else f"serve exited {proc.returncode}",
                     args.start_timeout, "the server did not start")
        with httpx.Client(base_url=url, timeout=120) as http:
            limit = int(next(w.split("=")[1] for w in open(log.name).read().replace(",", " ").split()
                             if w.startswith("max_body_bytes=")))
            for name, run in (("ratio", lambda: probe_ratio(http)), ("amplified", lambda: probe_amplified(url, proc.pid)),
                              ("unread", lambda: probe_unread(url, port, proc.pid, http)),
                              ("gapless", lambda: probe_gapless(http, port)), ("chunked", lambda: probe_chunked(port, limit)),
                              ("idle", lambda: probe_idle(port))):
                results[name] = run()
                print(f"{name}: {json.dumps(results[name])}", flush=True)
            results["server_alive"] = http.get("/health").status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
