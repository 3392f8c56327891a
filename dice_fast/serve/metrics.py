"""Prometheus metrics of the server, in the text exposition format (version 0.0.4), with no dependency.

`Registry` holds counters, callback gauges and histograms and renders them; `ServerMetrics` is the set
the app exposes at ``GET /metrics``:

    dice_fast_requests_total{input_type, status}        embedding requests by outcome (499: client gone)
    dice_fast_unauthorized_total{reason}                401s: API key missing or invalid
    dice_fast_inputs_total{input_type}                  inputs embedded
    dice_fast_prompt_tokens_total{input_type}           tokens of the inputs embedded (usage.prompt_tokens)
    dice_fast_request_duration_seconds{input_type}      latency of successful requests (histogram)
    dice_fast_queue_tokens                              tokens waiting to run (what --max-queue-tokens bounds)
    dice_fast_requests_in_flight                        requests being tokenized, queued or run
    dice_fast_batch_tokens_total                        tokens the model ran
    dice_fast_batch_fill_ratio                          tokens per forward / token budget (histogram)
    dice_fast_batch_requests                            requests sharing a forward (histogram)
    dice_fast_batch_duration_seconds                    time per forward (histogram)
    dice_fast_chunks_total{source}                      chunk vectors by source: computed, deduplicated
                                                        (shared an identical queued chunk's forward), memory, disk
    dice_fast_chunk_cache_lookups_total{tier, result}   chunk lookups in the memory and disk caches: hit, miss

All updates are thread-safe (the worker thread observes batches, the event loop requests).
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
SHARE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(v: float) -> str:
    """Prometheus' spelling of a float (as its Python client writes it: 1.0, 0.25, +Inf)."""
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count per label set."""

    kind = "counter"

    def __init__(self, name, help, labelnames=()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple, float] = {}

    def inc(self, amount: float = 1, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels) -> float:
        return self._values.get(self._key(labels), 0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.labelnames:
            items = [((), 0)]
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_number(v)}" for k, v in items]


class Gauge(_Metric):
    """A value read from ``fn()`` when scraped."""

    kind = "gauge"

    def __init__(self, name, help, fn: Callable[[], float]):
        super().__init__(name, help)
        self.fn = fn

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_number(self.fn())}"]


class ReadCounter(_Metric):
    """A counter kept elsewhere: ``fn()`` returns {label values tuple: count} when scraped."""

    kind = "counter"

    def __init__(self, name, help, labelnames, fn: Callable[[], dict]):
        super().__init__(name, help, labelnames)
        self.fn = fn

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_number(v)}"
                                for k, v in sorted(self.fn().items())]


class Histogram(_Metric):
    """Observations counted into cumulative ``le`` buckets per label set, with their sum and count."""

    kind = "histogram"

    def __init__(self, name, help, buckets: Sequence[float], labelnames=()):
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._data: dict[tuple, list] = {}  # key -> [counts per bucket..., sum]

    def observe(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            data = self._data.setdefault(key, [0] * len(self.buckets) + [0.0])
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    data[i] += 1
                    break
            data[-1] += value

    def count(self, **labels) -> int:
        """Observations made with ``labels``."""
        with self._lock:
            return int(sum(self._data.get(self._key(labels), [0, 0.0])[:-1]))

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._data.items())
        if not items and not self.labelnames:
            items = [((), [0] * len(self.buckets) + [0.0])]
        lines = self.header()
        for key, data in items:
            running = 0
            for bound, n in zip(self.buckets, data):
                running += n
                le = 'le="' + _number(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {running}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_number(data[-1])}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {running}")
        return lines


class Registry:
    """An ordered set of metrics rendered together."""

    def __init__(self):
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self._metrics for line in m.render()) + "\n"


class ServerMetrics:
    """The metrics of one app over one `AsyncDiceEncoder` (see the module docstring)."""

    def __init__(self, core):
        r = self.registry = Registry()
        self.requests = r.add(Counter("dice_fast_requests_total", "Embedding requests by input type and HTTP status.",
                                      ("input_type", "status")))
        self.unauthorized = r.add(Counter("dice_fast_unauthorized_total",
                                          "Requests refused with 401: no API key, or a wrong one.", ("reason",)))
        self.inputs = r.add(Counter("dice_fast_inputs_total", "Inputs embedded.", ("input_type",)))
        self.tokens = r.add(Counter("dice_fast_prompt_tokens_total", "Tokens of the inputs embedded.", ("input_type",)))
        self.latency = r.add(Histogram("dice_fast_request_duration_seconds", "Latency of successful requests.",
                                       LATENCY_BUCKETS, ("input_type",)))
        r.add(Gauge("dice_fast_queue_tokens", "Tokens waiting to run.", lambda: core.tokens_waiting))
        r.add(Gauge("dice_fast_requests_in_flight", "Requests being tokenized, queued or run.",
                    lambda: core.requests_in_flight))
        self.batch_tokens = r.add(Counter("dice_fast_batch_tokens_total", "Tokens run by the model."))
        self.batch_fill = r.add(Histogram("dice_fast_batch_fill_ratio", "Tokens per forward over the token budget.",
                                          FILL_BUCKETS))
        self.batch_requests = r.add(Histogram("dice_fast_batch_requests", "Requests sharing one forward.",
                                              SHARE_BUCKETS))
        self.batch_seconds = r.add(Histogram("dice_fast_batch_duration_seconds", "Time per forward.", LATENCY_BUCKETS))
        r.add(ReadCounter("dice_fast_chunks_total", "Chunk vectors by source.", ("source",),
                          lambda: _chunk_sources(core.chunk_stats.snapshot())))
        r.add(ReadCounter("dice_fast_chunk_cache_lookups_total", "Chunk lookups in the memory and disk caches.",
                          ("tier", "result"), lambda: _cache_lookups(core.chunk_stats.snapshot())))
        core.add_batch_listener(self.observe_batch)

    def observe_request(self, input_type: str, status: int, seconds: float | None = None, inputs: int = 0,
                        tokens: int = 0) -> None:
        """Count one request; a successful one also adds its inputs, tokens and latency."""
        self.requests.inc(input_type=input_type, status=str(status))
        if status == 200:
            self.inputs.inc(inputs, input_type=input_type)
            self.tokens.inc(tokens, input_type=input_type)
            if seconds is not None:
                self.latency.observe(seconds, input_type=input_type)

    def observe_unauthorized(self, reason: str) -> None:
        """Count one 401 (``reason``: "missing" or "invalid"); these never reach the request counter."""
        self.unauthorized.inc(reason=reason)

    def observe_batch(self, stats) -> None:
        """A `BatchStats` from the worker."""
        self.batch_tokens.inc(stats.tokens)
        self.batch_fill.observe(stats.fill)
        self.batch_requests.observe(stats.requests)
        self.batch_seconds.observe(stats.seconds)

    def render(self) -> str:
        return self.registry.render()


def _chunk_sources(stats: dict) -> dict:
    return {("computed",): stats["computed"], ("deduplicated",): stats["deduplicated"],
            ("memory",): stats["memory_hits"], ("disk",): stats["disk_hits"]}


def _cache_lookups(stats: dict) -> dict:
    return {(tier, result): stats[f"{tier}_{name}"] for tier in ("memory", "disk")
            for result, name in (("hit", "hits"), ("miss", "misses"))}
