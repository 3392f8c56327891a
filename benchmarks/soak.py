"""Soak test of ``dice-fast serve`` (bundled model, loopback only): does the server stay correct, small
and responsive under a long mix of good, oversize, malformed and abandoned requests and injected faults?

    python benchmarks/soak.py                      # 10 minutes at 80 % of the measured capacity
    python benchmarks/soak.py --duration 20        # a quick check of the script itself

1. Starts ``dice-fast serve`` on 127.0.0.1 (a free port, its default limits, an API key from
   $DICE_FAST_API_KEY) with the hidden testing flag ``--testing-inject-oom FRACTION``: that fraction of
   the model's forwards raises ``torch.OutOfMemoryError`` (`dice_fast.serve.fault_injection`).
2. Measures capacity: ``--clients`` closed-loop clients sending one-document requests for
   ``--capacity-seconds``; capacity = requests answered 200 per second.
3. For ``--duration`` seconds sends requests open-loop (Poisson arrivals) at ``--load`` x capacity, a mix
   (`MIX`) of good documents and queries (every vector checked against this process's offline encoder),
   malformed bodies, requests without the key, bodies over the byte limit, queries over the window,
   inputs over the token limit, and clients that give up after 50 ms (disconnects).
4. Reports requests sent, answers by kind and status, 5xx (on requests that reach the model, where an
   injected fault may land, and on those that never do: must be 0), wrong vectors (must be 0), p50/p99
   latency of good requests, the server's resident memory (after the capacity phase, its peak and the
   last sample of each minute under load, at the end, and after a 3 s quiet pause), and
   the faults injected (counted in the server's log). Prints a table, appends a row to ``--csv``.
Exit code 1 when a request that never reaches the model got a 5xx or a vector was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone

import numpy as np

from dice_fast.serve.bench import decode_embeddings, free_port, make_corpus, wait_healthy

# kind -> share of the requests; "reaches_model" kinds may meet an injected fault
MIX = {"document": 0.70, "query": 0.10, "malformed": 0.06, "unauthorized": 0.03, "over_body": 0.02,
       "long_query": 0.02, "over_tokens": 0.003, "disconnect": 0.067}
REACHES_MODEL = {"document", "query", "disconnect"}
EXPECTED = {"document": {200, 429}, "query": {200, 429}, "malformed": {400, 415}, "unauthorized": {401},
            "over_body": {413}, "long_query": {413}, "over_tokens": {413}}
MALFORMED = [  # (body, content type)
    (b'{"input": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "application/json"),
    (b'{"input": "lone \\ud800 surrogate"}', "application/json"),
    (b'{"input": "a", "dimensions": NaN}', "application/json"),
    (b'{"input": "a", "input": "b"}', "application/json"),
    (b'{"input": ["ok", 5]}', "application/json"),
    (b'{"input": "a", "encoding_format": "int8"}', "application/json"),
    (b'{"input": ', "application/json"),
    (b"", "application/json"),
    (b'{"input": "a"}', "text/plain"),
]
MAX_OUTSTANDING = 512
FIELDS = ("date", "device", "model", "duration_s", "capacity_rps", "target_rps", "sent", "good_200", "good_429",
          "p50_ms", "p99_ms", "5xx_model", "5xx_other", "wrong_vectors", "faults_injected", "disconnects",
          "dropped", "transport_errors", "rss_start_mb", "rss_end_mb", "fault_fraction", "torch", "dice_fast",
          "rss_peak_mb", "rss_idle_mb", "rss_minutes")
IDLE_PAUSE_S = 3.0  # after the load: longer than the worker's quiet period before it trims the heap


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of soak (default 600)")
    p.add_argument("--capacity-seconds", type=float, default=15.0, help="seconds of capacity measurement (default 15)")
    p.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of capacity (default 0.8)")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients measuring capacity (default 8)")
    p.add_argument("--fault-fraction", type=float, default=0.01,
                   help="fraction of forwards failing with an injected out-of-memory error (default 0.01; 0: none)")
    p.add_argument("--docs", type=int, default=64, help="good documents in the pool (default 64)")
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--cache-memory-mb", type=int, default=0,
                   help="the server's in-memory chunk store (default 0: the pool's documents repeat, and with the "
                        "store on they would be answered from memory instead of loading the model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for the server to start")
    p.add_argument("--csv", default="benchmarks/soak.csv", help="append the result row here ('' to skip)")
    return p.parse_args(argv)


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


class RssSampler:
    """``with RssSampler(pid) as r:`` the resident memory of ``pid`` every ``every`` seconds in a
    thread; ``r.samples`` holds (seconds since start, MiB)."""

    def __init__(self, pid: int, every: float = 5.0):
        self.pid, self.every, self.samples = pid, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        t0 = time.perf_counter()
        while True:
            self.samples.append((time.perf_counter() - t0, rss_mb(self.pid)))
            if self._stop.wait(self.every):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def per_minute(self) -> str:
        """The last sample of each minute, 'MiB MiB ...' (a compact trend for the CSV)."""
        last: dict[int, float] = {}
        for t, mb in self.samples:
            last[int(t // 60)] = mb
        return " ".join(f"{last[m]:.0f}" for m in sorted(last))


class Server:
    """``with Server(args) as s:`` dice-fast serve in a child process; s.url, s.key, s.proc, s.limits, s.log."""

    def __init__(self, args):
        self.port, self.key = free_port(), secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="dice-fast-soak-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "dice_fast.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--no-access-log", "--log-level", "warning", "--device", args.device, "--dtype", args.dtype,
               "--cache-memory-mb", str(args.cache_memory_mb)]
        if args.fault_fraction:
            cmd += ["--testing-inject-oom", str(args.fault_fraction)]
        self.cmd, self.timeout = cmd, args.start_timeout

    def __enter__(self):
        env = {**os.environ, "DICE_FAST_API_KEY": self.key}
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        wait_healthy(self.url, lambda: None if self.proc.poll() is None else
                     f"dice-fast serve exited with {self.proc.returncode}:\n{self.read_log()[-3000:]}",
                     self.timeout, f"dice-fast serve did not start within {self.timeout} s")
        printed = self.read_log()
        self.limits = {k: int(v) for k, v in re.findall(r"(max_\w+)=(\d+)", printed)}
        return self

    def read_log(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


class Requests:
    """Builds one request of each kind; checks good answers against the offline vectors."""

    def __init__(self, docs, queries, ref_docs, ref_queries, long_query, limits, key, rng):
        self.docs, self.queries, self.ref_docs, self.ref_queries = docs, queries, ref_docs, ref_queries
        self.long_query, self.limits, self.rng = long_query, limits, rng
        self.auth = {"Authorization": f"Bearer {key}"}
        limit = limits["max_body_bytes"]
        self.over_body = b'{"input": "' + b"a" * limit + b'"}'
        words = (" ".join(docs)).split()  # more tokens than the queue holds, fewer bytes than the body limit
        text = " ".join(words * (limits["max_queue_tokens"] // max(1, len(words)) + 2))
        self.over_tokens = {"input": text[: min(limit - 100, limits["max_input_chars"]) - 100]}

    def build(self, kind: str):
        """(json or None, content or None, headers, pick, reference or None, timeout)."""
        rng, auth = self.rng, self.auth
        if kind in ("document", "disconnect"):
            pick = [rng.randrange(len(self.docs)) for _ in range(rng.randint(1, 3))]
            body = {"input": [self.docs[i] for i in pick], "encoding_format": rng.choice(["float", "base64"])}
            return body, None, auth, pick, self.ref_docs, 0.05 if kind == "disconnect" else 120
        if kind == "query":
            pick = [rng.randrange(len(self.queries)) for _ in range(rng.randint(1, 4))]
            body = {"input": [self.queries[i] for i in pick], "input_type": "query"}
            return body, None, auth, pick, self.ref_queries, 120
        if kind == "malformed":
            content, ctype = rng.choice(MALFORMED)
            return None, content, {**auth, "Content-Type": ctype}, None, None, 120
        if kind == "unauthorized":
            return {"input": self.docs[0]}, None, rng.choice([{}, {"Authorization": "Bearer wrong"}]), None, None, 120
        if kind == "over_body":
            return None, self.over_body, {**auth, "Content-Type": "application/json"}, None, None, 120
        if kind == "long_query":
            return {"input": [self.long_query], "input_type": "query"}, None, auth, None, None, 120
        return self.over_tokens, None, auth, None, None, 120  # over_tokens


async def send(http, requests: Requests, kind: str, stats: dict) -> None:
    import httpx

    body, content, headers, pick, ref, timeout = requests.build(kind)
    t0 = time.perf_counter()
    try:
        r = await http.post("/v1/embeddings", json=body, content=content, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        stats["status"][(kind, "timeout")] += 1
        return
    except httpx.TransportError:
        stats["status"][(kind, "transport_error")] += 1
        return
    seconds = time.perf_counter() - t0
    stats["status"][(kind, r.status_code)] += 1
    if r.status_code == 200 and pick is not None:
        if kind != "disconnect":
            stats["latency"].append(seconds)
        if not np.allclose(decode_embeddings(r.json()), ref[pick], atol=1e-4, rtol=0):
            stats["wrong"] += 1


async def capacity(url, requests: Requests, clients: int, seconds: float) -> float:
    """Requests answered 200 per second by ``clients`` closed-loop clients sending documents."""
    import httpx

    done = [0]
    end = time.monotonic() + seconds

    async def client(http):
        while time.monotonic() < end:
            body, _, headers, *_ = requests.build("document")
            if (await http.post("/v1/embeddings", json=body, headers=headers, timeout=120)).status_code == 200:
                done[0] += 1

    async with httpx.AsyncClient(base_url=url) as http:
        start = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return done[0] / (time.monotonic() - start)


async def soak(url, requests: Requests, rate: float, duration: float, rng: random.Random) -> dict:
    """Open-loop Poisson arrivals at ``rate`` per second for ``duration`` seconds."""
    import httpx

    stats = {"status": Counter(), "latency": [], "wrong": 0, "dropped": 0, "sent": 0}
    kinds, weights = list(MIX), list(MIX.values())
    tasks: set = set()
    limits = httpx.Limits(max_connections=MAX_OUTSTANDING, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits) as http:
        end = next_at = time.monotonic()
        end += duration
        while (now := time.monotonic()) < end:
            if next_at > now:
                await asyncio.sleep(next_at - now)
            next_at += rng.expovariate(rate)
            if len(tasks) >= MAX_OUTSTANDING:
                stats["dropped"] += 1
                continue
            task = asyncio.create_task(send(http, requests, rng.choices(kinds, weights)[0], stats))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            stats["sent"] += 1
        await asyncio.gather(*tasks)
    return stats


def main(argv=None) -> int:
    args = parse_args(argv)
    from dice_fast import DiceEncoder
    from dice_fast.runinfo import append_csv, device_name, model_label, versions

    rng = random.Random(args.seed)
    encoder = DiceEncoder.from_pretrained(device=args.device, dtype=args.dtype)
    docs = make_corpus(encoder.tokenizer, args.docs, args.min_tokens, args.max_tokens, args.seed)
    queries = [" ".join(d.split()[:12]) for d in docs]
    long_query = " ".join(" ".join(docs).split()[: 2 * encoder.window])  # over the window: 413 (no auto-truncate)
    ref_docs, ref_queries = encoder.encode_documents(docs), encoder.encode_queries(queries)
    with Server(args) as server:
        requests = Requests(docs, queries, ref_docs, ref_queries, long_query, server.limits, server.key, rng)
        cap = asyncio.run(capacity(server.url, requests, args.clients, args.capacity_seconds))
        rss_start = rss_mb(server.proc.pid)
        rate = max(0.1, args.load * cap)
        print(f"soak: capacity {cap:.2f} requests/s; {args.duration:.0f} s at {rate:.2f}/s; "
              f"server RSS {rss_start:.0f} MiB", flush=True)
        with RssSampler(server.proc.pid) as rss:
            stats = asyncio.run(soak(server.url, requests, rate, args.duration, rng))
        rss_end = rss_mb(server.proc.pid)
        time.sleep(IDLE_PAUSE_S)  # quiet: the worker hands its kept heap back (`dice_fast.cpu_heap`)
        rss_idle = rss_mb(server.proc.pid)
        faults = server.read_log().count("injected torch.OutOfMemoryError #")
    status = stats["status"]
    five = {k: n for k, n in status.items() if isinstance(k[1], int) and k[1] >= 500}
    five_model = sum(n for (kind, _), n in five.items() if kind in REACHES_MODEL)
    five_other = sum(five.values()) - five_model
    unexpected = {k: n for k, n in status.items() if k[0] in EXPECTED and k[1] not in EXPECTED[k[0]] and k not in five}
    lat = np.asarray(stats["latency"] or [np.nan]) * 1000
    row = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "device": device_name(encoder.device),
           "model": model_label(encoder.spec.name), "duration_s": args.duration, "capacity_rps": round(cap, 3),
           "target_rps": round(rate, 3), "sent": stats["sent"], "good_200": status[("document", 200)] +
           status[("query", 200)], "good_429": status[("document", 429)] + status[("query", 429)],
           "p50_ms": round(float(np.percentile(lat, 50)), 1), "p99_ms": round(float(np.percentile(lat, 99)), 1),
           "5xx_model": five_model, "5xx_other": five_other, "wrong_vectors": stats["wrong"], "faults_injected": faults,
           "disconnects": status[("disconnect", "timeout")], "dropped": stats["dropped"],
           "transport_errors": sum(n for (_, s), n in status.items() if s == "transport_error"),
           "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
           "rss_peak_mb": round(max(mb for _, mb in rss.samples + [(0, rss_end)]), 1), "rss_idle_mb": round(rss_idle, 1),
           "rss_minutes": rss.per_minute(), "fault_fraction": args.fault_fraction,
           **{k: v for k, v in versions().items() if k in FIELDS}}
    print(f"\n{'kind':<14}" + "".join(f"{s!s:>9}" for s in sorted({s for _, s in status}, key=str)))
    for kind in MIX:
        print(f"{kind:<14}" + "".join(f"{status[(kind, s)]:>9}" for s in sorted({s for _, s in status}, key=str)))
    print()
    for k in FIELDS:
        print(f"  {k:<18} {row[k]}")
    if unexpected:
        print(f"  unexpected answers: {dict(unexpected)}")
    if args.csv:
        append_csv([row], args.csv, FIELDS)
        print(f"  row appended to {args.csv}")
    return 1 if five_other or stats["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
