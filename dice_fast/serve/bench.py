"""``dice-fast bench-serve``: the server under closed-loop load against offline ``encode_documents``.

One corpus of real prose cut to token lengths (log-uniform between ``--min-tokens`` and
``--max-tokens``). Offline: ``encode_documents(corpus)`` in this process (after a warm-up; the
median of ``--offline-repeats`` runs). Then
the server, in a child process on 127.0.0.1 built from the same model options, once with
cross-request batching and once without; for each client count, that many closed-loop clients
(each sends its next request as soon as the last one is answered) go through the corpus in
requests of ``--docs-per-request`` documents. Every response is checked against the offline vectors.
Every chunk runs, offline and served (``dedup`` off, no memory cache): the server's chunk memory would
otherwise answer every round after the first, and the rows would time the cache, not the batching; each
row counts the chunks the server computed for it (``chunks_computed``, from ``/metrics``).

Reported per (batching, clients): documents/s, tokens/s (the requests' usage.prompt_tokens: wrapped
chunk tokens), p50/p99 request latency, the ratio to offline documents/s, and, for cross-request
batching, the ratio to the same server without it. Clients and server share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import socket
import time
from datetime import datetime, timezone

import numpy as np

FIELDS = ("date", "device", "model", "batching", "clients", "requests", "documents", "tokens", "chunks_computed",
          "seconds", "docs_per_s", "tokens_per_s", "p50_ms", "p99_ms", "vs_offline", "vs_per_request", "max_abs_err",
          "docs_per_request", "encoding_format", "max_batch_tokens", "torch")


def make_corpus(tokenizer, n_docs: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n_docs`` passages of the bundled prose, each cut at token boundaries to a length drawn
    log-uniformly from [lo, hi] tokens."""
    from ..data import prose_documents

    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= --min-tokens <= --max-tokens, got {lo} and {hi}")
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n_docs)).astype(np.int64).clip(lo, hi)
    return prose_documents(tokenizer, lengths, seed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_app(encoder, cross: bool):
    """The benchmark's app over ``encoder``: limits out of the way, no chunk memory across requests."""
    from .app import create_app

    return create_app(encoder, max_queue_tokens=1 << 30, max_inputs_per_request=1 << 20,
                      max_concurrent_requests=1 << 20, cross_request_batching=cross, cache_memory_mb=0)


def _serve(options: dict, port: int, cross: bool) -> None:
    """Child process: the server for the benchmark (SIGTERM ends it gracefully)."""
    import signal
    import sys

    import uvicorn

    from ..cliargs import make_encoder

    # uvicorn raises the SIGTERM it stopped on again once stopped: exit, so that the process's finalizers run
    # (killed by the signal, it left its semaphores to the resource tracker, which warned at every run's end)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    uvicorn.run(bench_app(make_encoder(argparse.Namespace(**options)), cross), host="127.0.0.1", port=port,
                log_level="warning", access_log=False)


class _Server:
    """``with _Server(options, cross) as url:`` a benchmark server in a child process."""

    def __init__(self, options: dict, cross: bool, timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=_serve, args=(options, self.port, cross), daemon=True)
        self.timeout = timeout

    def __enter__(self) -> str:
        self.proc.start()
        wait_healthy(self.url, lambda: None if self.proc.is_alive() else
                     f"the benchmark server exited with code {self.proc.exitcode}",
                     self.timeout, "the benchmark server did not start in time")
        return self.url

    def __exit__(self, *exc) -> None:
        self.proc.terminate()  # SIGTERM: graceful
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def wait_healthy(url: str, exited, timeout: float, late: str) -> None:
    """Poll ``url``/health until it answers 200. ``exited()`` returns why the server process is gone
    (RuntimeError with that text) or None while it runs; after ``timeout`` seconds, TimeoutError(``late``)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if (why := exited()) is not None:
            raise RuntimeError(why)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(late)
        time.sleep(0.2)


def computed_chunks(metrics: str) -> float:
    """``dice_fast_chunks_total{source="computed"}`` in a server's ``/metrics`` text."""
    for line in metrics.splitlines():
        if line.startswith('dice_fast_chunks_total{source="computed"}'):
            return float(line.split()[-1])
    raise RuntimeError("the server's /metrics has no dice_fast_chunks_total{source=\"computed\"}")


def decode_embeddings(body: dict) -> np.ndarray:
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if isinstance(d["embedding"], str)
            else np.asarray(d["embedding"], np.float32) for d in body["data"]]
    return np.stack(rows)


async def _closed_loop(url: str, requests: list[list[int]], texts: list[str], ref: np.ndarray, clients: int,
                       encoding_format: str, timeout: float) -> dict:
    """``clients`` closed-loop clients over ``requests`` (lists of corpus indices)."""
    import httpx

    queue = iter(range(len(requests)))
    latencies, tokens, errors = [], [0], [0.0]

    async def client(http):
        for r in queue:
            pick = requests[r]
            t0 = time.perf_counter()
            resp = await http.post("/v1/embeddings", json={"input": [texts[i] for i in pick],
                                                           "encoding_format": encoding_format})
            latencies.append(time.perf_counter() - t0)
            if resp.status_code != 200:
                raise RuntimeError(f"request {r}: HTTP {resp.status_code}: {resp.text[:300]}")
            body = json.loads(resp.content)
            tokens[0] += body["usage"]["prompt_tokens"]
            errors[0] = max(errors[0], float(np.abs(decode_embeddings(body) - ref[pick]).max()))

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        await http.post("/v1/embeddings", json={"input": texts[:2]})  # connection and path warm-up
        computed = computed_chunks((await http.get("/metrics")).text)
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client(http) for _ in range(clients))), timeout)
        seconds = time.perf_counter() - start
        computed = computed_chunks((await http.get("/metrics")).text) - computed
    lat = np.asarray(latencies) * 1000
    return {"requests": len(requests), "seconds": seconds, "tokens": tokens[0], "chunks_computed": int(computed),
            "max_abs_err": errors[0],
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}


def run_bench_serve(args) -> int:
    """The ``bench-serve`` command (see the module docstring). Returns 0."""
    import torch

    from ..cliargs import make_encoder
    from ..runinfo import append_csv, device_name, model_label

    try:
        clients = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must list client counts >= 1, got {args.concurrency!r}") from None
    for name, value in (("docs", args.docs), ("docs-per-request", args.docs_per_request), ("passes", args.passes),
                        ("offline-repeats", args.offline_repeats)):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if not clients or min(clients) < 1:
        raise ValueError(f"--concurrency must list client counts >= 1, got {args.concurrency!r}")
    args.dedup = False  # every chunk runs, offline and served (module docstring)
    enc = make_encoder(args)
    texts = make_corpus(enc.tokenizer, args.docs, args.min_tokens, args.max_tokens, args.seed)
    n_tokens = int(enc.plan(texts).document_tokens.sum())
    enc.encode_documents(texts[: min(8, len(texts))])  # warm-up
    times = []
    for _ in range(args.offline_repeats):  # the median of a few timed runs
        t0 = time.perf_counter()
        ref = enc.encode_documents(texts)
        times.append(time.perf_counter() - t0)
    offline_s = float(np.median(times))
    offline_dps = len(texts) / offline_s
    k = args.docs_per_request
    requests = [list(range(i, min(i + k, len(texts)))) for i in range(0, len(texts), k)] * args.passes

    base = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "device": device_name(enc.device),
            "model": model_label(enc.spec.name), "docs_per_request": k, "encoding_format": args.encoding_format,
            "max_batch_tokens": enc.max_batch_tokens, "torch": torch.__version__}
    rows = [{**base, "batching": "offline encode_documents", "clients": "", "requests": "",
             "documents": len(texts), "tokens": n_tokens, "seconds": offline_s, "docs_per_s": offline_dps,
             "tokens_per_s": n_tokens / offline_s, "vs_offline": 1.0}]
    options = {key: v for key, v in vars(args).items() if key != "func"}  # the server's model options
    per_request = {}
    modes = [("per-request", False)] * (not args.no_baseline) + [("cross-request", True)]
    for label, cross in modes:
        with _Server(options, cross, args.timeout) as url:
            for c in clients:
                res = asyncio.run(_closed_loop(url, requests, texts, ref, c, args.encoding_format, args.timeout))
                docs = sum(len(r) for r in requests)
                dps = docs / res["seconds"]
                row = {**base, **res, "batching": label, "clients": c, "documents": docs,
                       "docs_per_s": dps, "tokens_per_s": res["tokens"] / res["seconds"],
                       "vs_offline": dps / offline_dps}
                if cross and c in per_request:
                    row["vs_per_request"] = dps / per_request[c]
                if not cross:
                    per_request[c] = dps
                rows.append(row)
                print(_format_row(row), flush=True)
    print()
    print(format_table(rows))
    print(f"\n{base['device']}; torch {torch.__version__}; {enc!r}")
    print(f"corpus: {len(texts)} documents, {n_tokens:,} tokens ({args.min_tokens}-{args.max_tokens} text tokens "
          f"each, seed {args.seed}); {k} document(s) per request; {args.encoding_format} responses")
    if args.csv:
        append_csv(rows, args.csv, FIELDS)
        print(f"rows appended to {args.csv}")
    return 0


def _format_row(row: dict) -> str:
    return (f"{row['batching']:>24} clients={row['clients']!s:>3}  {row['docs_per_s']:8.1f} docs/s  "
            f"{row['tokens_per_s']:9,.0f} tokens/s  x{row['vs_offline']:.2f} offline")


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the rows."""
    head = ("| batching | clients | docs/s | tokens/s | p50 ms | p99 ms | vs offline | vs per-request |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head]
    for r in rows:
        def num(key, fmt):
            return format(r[key], fmt) if isinstance(r.get(key), (int, float)) else ""

        ratios = [num(key, ".2f") + "x" if key in r else "" for key in ("vs_offline", "vs_per_request")]
        lines.append(f"| {r['batching']} | {r['clients']} | {num('docs_per_s', '.1f')} | "
                     f"{num('tokens_per_s', ',.0f')} | {num('p50_ms', '.0f')} | {num('p99_ms', '.0f')} | "
                     f"{ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)
