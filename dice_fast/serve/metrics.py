"""Prometheus metrics of the server, through `prometheus_client` (the ``serve`` extra), in a registry
of the app's own; `ServerMetrics` is the set the app exposes at ``GET /metrics``:

    dice_fast_requests_total{input_type, status}        requests by outcome (499: client gone)
    dice_fast_unauthorized_total{reason}                401s: API key missing or invalid
    dice_fast_wrong_host_total                          400s: a Host header the server does not answer to
    dice_fast_unrouted_total{status}                    404s (no such path) and 405s (a method the path
                                                        does not take); never labelled by path
    dice_fast_inputs_total{input_type}                  inputs embedded (evidence: the documents)
    dice_fast_prompt_tokens_total{input_type}           usage.prompt_tokens: the inputs' planned tokens, chunks
                                                        wrapped (evidence: the query's and the documents')
    dice_fast_request_duration_seconds{input_type}      latency of successful requests (histogram)
    dice_fast_queue_tokens                              tokens waiting to run
    dice_fast_held_tokens                               what --max-queue-tokens bounds: waiting, plus those
                                                        of requests whose responses are being sent
    dice_fast_requests_in_flight                        requests being read, tokenized, queued, run or sent
    dice_fast_batch_tokens_total                        tokens the model ran
    dice_fast_batch_fill_ratio                          tokens per forward / token budget (histogram)
    dice_fast_batch_requests                            requests sharing a forward (histogram)
    dice_fast_batch_duration_seconds                    time per forward (histogram)
    dice_fast_chunks_total{source}                      chunk vectors by source: computed, deduplicated
                                                        (shared an identical queued chunk's forward), memory, disk
    dice_fast_chunk_cache_lookups_total{tier, result}   chunk lookups in the memory and disk caches: hit, miss
    process_resident_memory_bytes, process_open_fds,    the process (prometheus_client's ProcessCollector;
    process_cpu_seconds_total, ...                      Linux)

All updates are thread-safe (the worker thread observes batches, the event loop requests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
SHARE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class _ReadCounters:
    """A collector of counters kept elsewhere: ``fn()`` returns {label values: count} when scraped."""

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...], fn):
        self.name, self.help, self.labelnames, self.fn = name, help, labelnames, fn

    def collect(self):
        family = CounterMetricFamily(self.name, self.help, labels=self.labelnames)
        for labels, value in sorted(self.fn().items()):
            family.add_metric(labels, value)
        yield family


class ServerMetrics:
    """The metrics of one app over one `AsyncDiceEncoder` (see the module docstring)."""

    def __init__(self, core):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("dice_fast_requests", "Requests by input type and HTTP status.",
                                ("input_type", "status"), registry=r)
        self.unauthorized = Counter("dice_fast_unauthorized", "Requests refused with 401: no API key, or a wrong one.",
                                    ("reason",), registry=r)
        self.wrong_host = Counter("dice_fast_wrong_host", "Requests refused with 400: a Host the server does not "
                                  "answer to.", registry=r)
        self.unrouted = Counter("dice_fast_unrouted", "Requests answered 404 (no such path) or 405 (a method the "
                                "path does not take).", ("status",), registry=r)
        self.inputs = Counter("dice_fast_inputs", "Inputs embedded (evidence: its documents).", ("input_type",),
                              registry=r)
        self.tokens = Counter("dice_fast_prompt_tokens", "usage.prompt_tokens: the inputs' planned tokens, every chunk "
                              "wrapped (evidence: its query's and documents').", ("input_type",), registry=r)
        self.latency = Histogram("dice_fast_request_duration_seconds", "Latency of successful requests.",
                                 ("input_type",), buckets=LATENCY_BUCKETS, registry=r)
        Gauge("dice_fast_queue_tokens", "Tokens waiting to run.", registry=r).set_function(lambda: core.tokens_waiting)
        Gauge("dice_fast_held_tokens", "Tokens waiting to run plus those of requests whose responses are being sent "
              "(what max_queue_tokens bounds).", registry=r).set_function(lambda: core.tokens_held)
        Gauge("dice_fast_requests_in_flight", "Requests being read, tokenized, queued, run or sent.",
              registry=r).set_function(lambda: core.requests_in_flight)
        self.batch_tokens = Counter("dice_fast_batch_tokens", "Tokens run by the model.", registry=r)
        self.batch_fill = Histogram("dice_fast_batch_fill_ratio", "Tokens per forward over the token budget.",
                                    buckets=FILL_BUCKETS, registry=r)
        self.batch_requests = Histogram("dice_fast_batch_requests", "Requests sharing one forward.",
                                        buckets=SHARE_BUCKETS, registry=r)
        self.batch_seconds = Histogram("dice_fast_batch_duration_seconds", "Time per forward.",
                                       buckets=LATENCY_BUCKETS, registry=r)
        r.register(_ReadCounters("dice_fast_chunks", "Chunk vectors by source.", ("source",),
                                 lambda: _chunk_sources(core.chunk_stats.snapshot())))
        r.register(_ReadCounters("dice_fast_chunk_cache_lookups", "Chunk lookups in the memory and disk caches.",
                                 ("tier", "result"), lambda: _cache_lookups(core.chunk_stats.snapshot())))
        ProcessCollector(registry=r)
        core.add_batch_listener(self.observe_batch, weak=True)  # a core shared by apps: each app's goes with it

    def observe_request(self, input_type: str, status: int, seconds: float | None = None, inputs: int = 0,
                        tokens: int = 0) -> None:
        """Count one request; a successful one also adds its inputs, tokens and latency."""
        self.requests.labels(input_type=input_type, status=str(status)).inc()
        if status == 200:
            self.inputs.labels(input_type=input_type).inc(inputs)
            self.tokens.labels(input_type=input_type).inc(tokens)
            if seconds is not None:
                self.latency.labels(input_type=input_type).observe(seconds)

    def observe_unauthorized(self, reason: str) -> None:
        """Count one 401 (``reason``: "missing" or "invalid"); these never reach the request counter."""
        self.unauthorized.labels(reason=reason).inc()

    def observe_wrong_host(self) -> None:
        """Count one 400 for a Host the server does not answer to."""
        self.wrong_host.inc()

    def observe_unrouted(self, status: int) -> None:
        """Count one request no route took (404, 405); by status only, so a client's paths add no series."""
        self.unrouted.labels(status=str(status)).inc()

    def observe_batch(self, stats) -> None:
        """A `BatchStats` from the worker."""
        self.batch_tokens.inc(stats.tokens)
        self.batch_fill.observe(stats.fill)
        self.batch_requests.observe(stats.requests)
        self.batch_seconds.observe(stats.seconds)

    def render(self) -> str:
        """The text exposition format (version 0.0.4) of every metric."""
        return generate_latest(self.registry).decode("utf-8")


def _chunk_sources(stats: dict) -> dict:
    return {("computed",): stats["computed"], ("deduplicated",): stats["deduplicated"],
            ("memory",): stats["memory_hits"], ("disk",): stats["disk_hits"]}


def _cache_lookups(stats: dict) -> dict:
    return {(tier, result): stats[f"{tier}_{name}"] for tier in ("memory", "disk")
            for result, name in (("hit", "hits"), ("miss", "misses"))}
