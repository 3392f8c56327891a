"""The async batching core: many concurrent requests, one worker thread, packed batches across requests.

    core = AsyncDiceEncoder(DiceEncoder.from_pretrained(), max_queue_tokens=100_000)
    out = await core.embed_documents(["a long document ...", "another"])   # from any coroutine
    out.vectors   # (2, dim) float32, exactly encoder.encode_documents(texts) (to float32 rounding)
    out.tokens    # (2,) int64 tokens the model ran per input, special tokens included

A request is tokenized and planned on the event loop's default executor, checked against the limits
and queued; one worker thread owns the model and forms token-budget batches first in, first out over
the chunks of every queued request (`dice_fast.scheduler.ChunkQueue`), so the documents of several
requests share one forward and a long document's chunks may span batches. When a request's last
chunk is pooled its vectors are handed back to its event loop. A request whose awaiting task is
cancelled (the client went away) drops its chunks that have not run yet.

Nothing here knows about HTTP: limits raise `RequestTooLarge` / `Overloaded` / `ShuttingDown`
(`dice_fast.serve.errors`) and the app maps them to status codes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from ..chunking import check_texts
from ..cpu_heap import release_freed_memory
from ..reuse import MemoryCache
from ..scheduler import ChunkQueue, Job
from .errors import Overloaded, RequestTooLarge, ShuttingDown
from .limits import DEFAULT_CACHE_MEMORY_MB, DEFAULT_LIMITS, QUEUE_BATCHES

IDLE_TRIM_S = 1.0  # seconds without work after which a CPU worker hands its kept heap pages back

log = logging.getLogger("dice_fast.serve")


@dataclass(frozen=True)
class Embeddings:
    """The result of one request. vectors: (n, dim) float32, row i is input i; tokens: (n,) int64
    tokens the model ran for input i (all its chunks, special tokens and prefix included)."""

    vectors: np.ndarray
    tokens: np.ndarray


@dataclass(frozen=True)
class BatchStats:
    """One forward of the worker: ``tokens`` of ``chunks`` chunks from ``requests`` requests, against a
    budget of ``budget`` tokens, in ``seconds``."""

    tokens: int
    chunks: int
    requests: int
    budget: int
    seconds: float

    @property
    def fill(self) -> float:
        """tokens / budget (above 1 only for a single chunk longer than the budget)."""
        return self.tokens / self.budget


@dataclass(eq=False)
class _Request:
    plan: object
    aggregation: str | None
    tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    job: Job | None = None
    keys: object = None  # the plan's chunk keys, computed off the event loop
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)


class AsyncDiceEncoder:
    """Awaitable DICE encoding with batches formed across concurrent requests.

    encoder: a `DiceEncoder` (or any object with its ``plan`` / ``run_batch`` / ``config`` / ``dim`` /
    ``max_batch_tokens`` API); the core is its only user of ``run_batch``.

    Limits (keyword arguments; defaults in `dice_fast.serve.limits`):
      max_inputs_per_request   more inputs in one call raise `RequestTooLarge`.
      max_tokens_per_document  an input of more tokens (special tokens included) raises `RequestTooLarge`
                               naming it; 0 = unlimited.
      max_queue_tokens         tokens waiting to run, all requests together; a request that would go over
                               raises `Overloaded` (retry later), one larger than the whole queue raises
                               `RequestTooLarge`. None = 64 x max_batch_tokens.
      max_concurrent_requests  calls in progress at once; one more raises `Overloaded`.
    max_batch_tokens: token budget of one forward (default: the encoder's).
    cross_request_batching: False runs one request at a time, each alone in its batches (the baseline
    the benchmark compares against).
    cache_memory_mb: chunk vectors kept in memory across requests (least recently used go first; 0: none),
    in front of the encoder's persistent cache if it has one; identical chunks queued at once run once
    either way. ``chunk_stats`` counts the reuse (`dice_fast.reuse.ChunkStats`).

    The worker thread starts on the first request; `close` / `aclose` (or ``async with``) drain the queue
    and stop it. Requests from several event loops may share one core.
    """

    def __init__(self, encoder, *, max_inputs_per_request: int = DEFAULT_LIMITS["max_inputs_per_request"],
                 max_tokens_per_document: int = DEFAULT_LIMITS["max_tokens_per_document"],
                 max_queue_tokens: int | None = DEFAULT_LIMITS["max_queue_tokens"],
                 max_concurrent_requests: int = DEFAULT_LIMITS["max_concurrent_requests"],
                 max_batch_tokens: int | None = None, cross_request_batching: bool = True,
                 cache_memory_mb: int = DEFAULT_CACHE_MEMORY_MB):
        for name, value, low in (("max_inputs_per_request", max_inputs_per_request, 1),
                                 ("max_tokens_per_document", max_tokens_per_document, 0),
                                 ("max_queue_tokens", max_queue_tokens, 1),
                                 ("max_concurrent_requests", max_concurrent_requests, 1),
                                 ("max_batch_tokens", max_batch_tokens, 1),
                                 ("cache_memory_mb", cache_memory_mb, 0)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.encoder = encoder
        # CPU: trim the heap (`dice_fast.cpu_heap`) once the queue has been empty this long
        self._trims_heap = getattr(getattr(encoder, "device", None), "type", None) == "cpu"
        self.idle_trim_s = IDLE_TRIM_S
        self.cache_memory_mb = cache_memory_mb
        memory = MemoryCache(cache_memory_mb << 20) if cache_memory_mb else None
        self._queue = ChunkQueue(encoder, max_batch_tokens, memory=memory)
        self.max_inputs_per_request = max_inputs_per_request
        self.max_tokens_per_document = max_tokens_per_document
        self.max_queue_tokens = max_queue_tokens or QUEUE_BATCHES * self._queue.max_batch_tokens
        self.max_concurrent_requests = max_concurrent_requests
        self.cross_request_batching = cross_request_batching
        self._cond = threading.Condition()
        self._pending: deque[_Request] = deque()  # planned, not yet handed to the ChunkQueue
        self._pending_tokens = 0
        self._current: Job | None = None  # the running job when cross_request_batching is off
        self._in_flight = 0
        self._closing = False
        self._worker: threading.Thread | None = None
        self._listeners: list[Callable[[BatchStats], None]] = []
        self._rate: float | None = None  # tokens/s of recent batches, for Retry-After

    # ---------------------------------------------------------------------------------- public
    @property
    def dim(self) -> int:
        """Width of the returned vectors."""
        return self.encoder.dim

    @property
    def chunk_stats(self):
        """Chunks computed, deduplicated and served from memory or the persistent cache (`ChunkStats`)."""
        return self._queue.stats

    @property
    def max_batch_tokens(self) -> int:
        """Token budget of one forward."""
        return self._queue.max_batch_tokens

    @property
    def tokens_waiting(self) -> int:
        """Tokens of queued requests not yet handed to a forward (what ``max_queue_tokens`` bounds)."""
        return self._queue.tokens_waiting + self._pending_tokens

    @property
    def requests_in_flight(self) -> int:
        """Calls in progress: being tokenized, queued or running."""
        return self._in_flight

    @property
    def closed(self) -> bool:
        return self._closing

    async def embed_documents(self, texts: Iterable[str]) -> Embeddings:
        """Encode n documents (chunked and aggregated) -> `Embeddings` with vectors (n, dim) float32,
        equal to ``encoder.encode_documents(texts)`` whatever else is in flight."""
        return await self._embed(texts, "documents", None)

    async def embed_queries(self, texts: Iterable[str]) -> Embeddings:
        """Encode n queries (one window each, never chunked) -> `Embeddings` with vectors (n, dim)
        float32, equal to ``encoder.encode_queries(texts)``."""
        return await self._embed(texts, "queries", "mean")

    def add_batch_listener(self, listener: Callable[[BatchStats], None]) -> None:
        """Call ``listener(stats)`` from the worker thread after every forward (e.g. for metrics)."""
        self._listeners.append(listener)

    def retry_after(self) -> int:
        """Seconds until the tokens now waiting have likely run (at least 1), from recent throughput."""
        if not self._rate:
            return 1
        return min(60, max(1, math.ceil(self.tokens_waiting / self._rate)))

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests (`ShuttingDown`), let the queued ones finish, and stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)

    async def aclose(self) -> None:
        """`close` without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def __aenter__(self) -> AsyncDiceEncoder:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (f"AsyncDiceEncoder({self.encoder!r}, max_inputs_per_request={self.max_inputs_per_request}, "
                f"max_tokens_per_document={self.max_tokens_per_document}, max_queue_tokens={self.max_queue_tokens}, "
                f"max_concurrent_requests={self.max_concurrent_requests}, max_batch_tokens={self.max_batch_tokens}, "
                f"cross_request_batching={self.cross_request_batching}, cache_memory_mb={self.cache_memory_mb})")

    # ------------------------------------------------------------------------- request side
    async def _embed(self, texts, kind: str, aggregation: str | None) -> Embeddings:
        if self._closing:
            raise ShuttingDown("the encoder is shutting down and takes no new requests")
        texts = check_texts(texts, "input")
        if len(texts) > self.max_inputs_per_request:
            raise RequestTooLarge(f"{len(texts)} inputs in one request; the limit is {self.max_inputs_per_request} "
                                  "(max_inputs_per_request)", param="input")
        with self._cond:
            if self._in_flight >= self.max_concurrent_requests:
                raise Overloaded(f"{self._in_flight} requests are in progress, the limit "
                                 f"(max_concurrent_requests); retry later", self.retry_after())
            self._in_flight += 1
        try:
            if not texts:
                return Embeddings(np.zeros((0, self.dim), np.float32), np.zeros(0, np.int64))
            if self.tokens_waiting >= self.max_queue_tokens:  # full already: do not spend time tokenizing
                raise self._queue_full(0)
            loop = asyncio.get_running_loop()
            plan = await loop.run_in_executor(None, self.encoder.plan, texts, kind)
            tokens = plan.document_tokens
            self._check_sizes(tokens)
            request = _Request(plan, aggregation, int(tokens.sum()), loop, loop.create_future())
            request.keys = await loop.run_in_executor(None, self._queue.keys_for, plan)
            self._submit(request)
            try:
                vectors = await request.future
            except asyncio.CancelledError:
                self._cancel(request)
                raise
            return Embeddings(vectors, tokens)
        finally:
            with self._cond:
                self._in_flight -= 1

    def _check_sizes(self, tokens: np.ndarray) -> None:
        limit = self.max_tokens_per_document
        if limit:
            over = np.flatnonzero(tokens > limit)
            if len(over):
                i = int(over[0])
                raise RequestTooLarge(f"input[{i}] has {int(tokens[i])} tokens; the limit is {limit} tokens per "
                                      "input, special tokens included (max_tokens_per_document)", param=f"input[{i}]")
        total = int(tokens.sum())
        if total > self.max_queue_tokens:
            raise RequestTooLarge(f"the request has {total} tokens, more than the {self.max_queue_tokens} tokens the "
                                  "queue holds (max_queue_tokens); split it into smaller requests", param="input")

    def _queue_full(self, tokens: int) -> Overloaded:
        return Overloaded(f"the queue holds {self.tokens_waiting} tokens; {tokens} more would pass its limit of "
                          f"{self.max_queue_tokens} (max_queue_tokens); retry later", self.retry_after())

    def _submit(self, request: _Request) -> None:
        with self._cond:
            if self._closing:
                raise ShuttingDown("the encoder is shutting down and takes no new requests")
            waiting = self.tokens_waiting
            if waiting and waiting + request.tokens > self.max_queue_tokens:
                raise self._queue_full(request.tokens)
            self._pending.append(request)
            self._pending_tokens += request.tokens
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="dice-fast-serve-worker", daemon=True)
                self._worker.start()
            self._cond.notify()

    def _cancel(self, request: _Request) -> None:
        with self._cond:
            request.cancelled = True
            if request.job is not None:
                self._queue.cancel(request.job)  # its chunks not handed out are dropped
            elif request in self._pending:
                self._pending.remove(request)
                self._pending_tokens -= request.tokens

    # --------------------------------------------------------------------------- worker side
    def _work(self) -> None:
        busy = False  # ran a batch since the heap was last trimmed
        while True:
            with self._cond:
                self._admit()
                batch = self._queue.next_batch()
                if batch is None:
                    if self._closing and not self._pending:
                        return
                    if not busy or not self._trims_heap:
                        self._cond.wait()
                        continue
                    if self._cond.wait(timeout=self.idle_trim_s):
                        continue  # woken within the quiet period: look for work again, no trim
            if batch is None:  # quiet for idle_trim_s: hand the kept activation pages back (CPU)
                busy = False
                release_freed_memory()
                continue
            busy = True
            self._run(batch)

    def _admit(self) -> None:
        """Hand planned requests to the ChunkQueue: all of them, or one at a time without cross-request
        batching. Called with ``_cond`` held."""
        while self._pending:
            if not self.cross_request_batching:
                cur = self._current
                if cur is not None and not (cur.done or cur.cancelled):
                    return
            request = self._pending.popleft()
            self._pending_tokens -= request.tokens
            request.job = self._current = self._queue.submit(request.plan, request.aggregation, tag=request,
                                                             keys=request.keys)
            if request.job.done:  # every chunk was in memory or the cache
                _settle(request, value=request.job.documents)

    def _run(self, batch) -> None:
        start = time.perf_counter()
        try:
            vectors = self.encoder.run_batch(batch.packed)
            finished = self._queue.complete(batch, vectors)
        except Exception as exc:  # the model failed: fail every request in the batch, keep serving
            log.exception("dice_fast.serve: a batch of %d tokens failed", batch.packed.n_tokens)
            with self._cond:
                for job in batch.jobs:
                    self._queue.cancel(job)
                    _settle(job.tag, exc=exc)
            return
        seconds = time.perf_counter() - start
        for job in finished:
            _settle(job.tag, value=job.documents)
        tokens = batch.packed.n_tokens
        rate = tokens / max(seconds, 1e-6)
        self._rate = rate if self._rate is None else 0.8 * self._rate + 0.2 * rate
        stats = BatchStats(tokens, len(batch.packed.chunk_ids), len(batch.jobs), self.max_batch_tokens, seconds)
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:  # a broken listener must not stop the worker
                log.exception("dice_fast.serve: batch listener %r failed", listener)


def _settle(request: _Request, value=None, exc: BaseException | None = None) -> None:
    """Resolve ``request``'s future on its own event loop (from the worker thread)."""

    def settle():
        if not request.future.done():
            if exc is not None:
                request.future.set_exception(exc)
            else:
                request.future.set_result(value)

    try:
        request.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # its event loop is closed: nobody is waiting
        pass
