"""The async batching core: many concurrent requests, one worker thread, packed batches across requests.

    core = AsyncDiceEncoder(DiceEncoder.from_pretrained(), max_queue_tokens=100_000)
    out = await core.embed_documents(["a long document ...", "another"])   # from any coroutine
    out.vectors   # (2, dim) float32, exactly encoder.encode_documents(texts) (to float32 rounding)
    out.tokens    # (2,) int64 tokens the model ran per input, special tokens included

A request is checked against the character limit, tokenized in bounded pieces and planned on the event
loop's default executor (`dice_fast.serve.planning`: the tokenizer lock is held per piece, and
tokenizing stops as soon as the request is over a token limit), checked and queued; one worker thread owns the model and forms token-budget batches first in, first out over
the chunks of every queued request (`dice_fast.chunk_queue.ChunkQueue`), so the documents of several
requests share one forward and a long document's chunks may span batches. When a request's last
chunk is pooled its vectors are handed back to its event loop. A request whose awaiting task is
cancelled (the client went away) or past its deadline (``request_timeout``) drops its chunks that
have not run yet.

Faults stay small. A batch that runs out of memory is split and retried down to single chunks while
the batch budget backs off (`ChunkQueue.run`, `dice_fast.faults`); a chunk that fails alone fails only
its own request (`OutOfMemory` naming the input). Any other error in the worker loop (admission,
packing, the forward, pooling) fails only the requests it touches and the worker goes on; if the worker
itself stops, the core is unhealthy and refuses new requests at once (`Unhealthy`). `health` is
"starting" until a forward has run (`start` runs a warm-up forward), "draining" once `drain` or
`close` was called.

Nothing here knows about HTTP: limits raise `RequestTooLarge` / `Overloaded` / `ShuttingDown` /
`DeadlineExceeded` (`dice_fast.serve.errors`) and the app maps them to status codes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import weakref
from collections import deque
from typing import Callable, Iterable


from ..reuse import MemoryCache
from ..chunk_queue import Job
from .admission import Embeddings, Lease, Part, QueuedRequest, RequestSide
from .limits import (DEFAULT_CACHE_MEMORY_MB, DEFAULT_LIMITS, QUEUE_BATCHES, check_limits,
                     default_max_input_chars)
from .planning import piece_chars
from .worker import BUSY_TRIM_S, IDLE_TRIM_S, BatchStats, WorkerLoop


log = logging.getLogger("dice_fast.serve")
__all__ = ["AsyncDiceEncoder", "BatchStats", "Embeddings", "Lease"]


class AsyncDiceEncoder(RequestSide, WorkerLoop):
    """Awaitable DICE encoding with batches formed across concurrent requests.

    encoder: a `DiceEncoder` (or any object with its ``tokenizer`` / ``plan_tokens`` / ``max_tokens_used`` /
    ``run_batch`` / ``window`` / ``dim`` / ``max_batch_tokens`` API and its tokenizer lock); the core is
    its only user of ``run_batch``.

    Limits (keyword arguments; defaults in `dice_fast.serve.limits`):
      max_inputs_per_request   more inputs in one call raise `RequestTooLarge`.
      max_input_chars          an input of more characters raises `RequestTooLarge` naming it, before
                               any tokenizing. None = 8 per token of the tightest token limit.
      max_tokens_per_document  an input of more tokens (special tokens included) raises `RequestTooLarge`
                               naming it; 0 = unlimited.
      max_queue_tokens         tokens waiting to run, all requests together; a request that would go over
                               raises `Overloaded` (retry later), one larger than the whole queue raises
                               `RequestTooLarge`. None = 64 x max_batch_tokens.
      max_concurrent_requests  calls in progress at once; one more raises `Overloaded`.
      request_timeout          seconds a call may take; past it, it raises `DeadlineExceeded` and its
                               chunks that have not run are dropped. 0 = no deadline.
      max_response_floats      floats of one call's result, width x (inputs + chunks returned with
                               ``return_chunks``), or the numbers per document a caller of
                               `embed_query_and_documents` returns instead; more raises `RequestTooLarge`
                               naming the sizes, before the forward (before tokenizing when the inputs
                               alone pass it).
    A call holds a share (`Lease`, see `dice_fast.serve.admission`) from its start until it returns,
    or, with ``lease=`` given, until that lease is released (the HTTP app: when the response is sent).
    max_batch_tokens: token budget of one forward (default: the encoder's).
    auto_truncate: a query longer than the window is cut to it (its index in ``Embeddings.truncated``);
    False (the default) raises `RequestTooLarge` naming it.
    cross_request_batching: False runs one request at a time, each alone in its batches (the baseline
    the benchmark compares against).
    cache_memory_mb: chunk vectors kept in memory across requests (least recently used go first; 0: none),
    in front of the encoder's persistent cache if it has one; identical chunks queued at once run once
    either way. ``chunk_stats`` counts the reuse (`dice_fast.reuse.ChunkStats`).

    The worker thread starts with `start` (which runs a warm-up forward first) or on the first request;
    `close` / `aclose` (or ``async with``) drain the queue and stop it. Requests from several event
    loops may share one core.
    """

    def __init__(self, encoder, *, max_inputs_per_request: int = DEFAULT_LIMITS["max_inputs_per_request"],
                 max_input_chars: int | None = DEFAULT_LIMITS["max_input_chars"],
                 max_tokens_per_document: int = DEFAULT_LIMITS["max_tokens_per_document"],
                 max_queue_tokens: int | None = DEFAULT_LIMITS["max_queue_tokens"],
                 max_concurrent_requests: int = DEFAULT_LIMITS["max_concurrent_requests"],
                 request_timeout: float = DEFAULT_LIMITS["request_timeout"],
                 max_response_floats: int = DEFAULT_LIMITS["max_response_floats"],
                 max_batch_tokens: int | None = None, cross_request_batching: bool = True,
                 auto_truncate: bool = False, cache_memory_mb: int = DEFAULT_CACHE_MEMORY_MB):
        limit = check_limits(  # by name, each count a plain int (a numpy integer is the int it holds)
            max_inputs_per_request=max_inputs_per_request, max_input_chars=max_input_chars,
            max_tokens_per_document=max_tokens_per_document, max_queue_tokens=max_queue_tokens,
            max_concurrent_requests=max_concurrent_requests, max_response_floats=max_response_floats,
            max_batch_tokens=max_batch_tokens, cache_memory_mb=cache_memory_mb, request_timeout=request_timeout)
        self.encoder = encoder
        # CPU: trim the heap (`dice_fast.cpu_heap`) once the queue has been empty this long, and at
        # most busy_trim_s apart under load
        self._trims_heap = getattr(getattr(encoder, "device", None), "type", None) == "cpu"
        self.idle_trim_s, self.busy_trim_s = IDLE_TRIM_S, BUSY_TRIM_S
        self.cache_memory_mb = limit["cache_memory_mb"]
        memory = MemoryCache(self.cache_memory_mb << 20) if self.cache_memory_mb else None
        self._queue = encoder.chunk_queue(limit["max_batch_tokens"], memory=memory)
        self.max_inputs_per_request = limit["max_inputs_per_request"]
        self.max_tokens_per_document = limit["max_tokens_per_document"]
        self.max_queue_tokens = limit["max_queue_tokens"] or QUEUE_BATCHES * self._queue.max_batch_tokens
        self.max_concurrent_requests = limit["max_concurrent_requests"]
        self.request_timeout = float(request_timeout)
        self.max_response_floats = limit["max_response_floats"]
        self.max_input_chars = limit["max_input_chars"] or default_max_input_chars(self.max_tokens_per_document,
                                                                                   self.max_queue_tokens)
        self.auto_truncate = bool(auto_truncate)
        self.cross_request_batching = cross_request_batching
        self._piece_chars = piece_chars(encoder)
        self._cond = threading.Condition()
        self._pending: deque[QueuedRequest] = deque()  # planned, not yet handed to the ChunkQueue
        self._pending_tokens = 0
        self._current: Job | None = None  # the running job when cross_request_batching is off
        self._in_flight = 0
        self._held_tokens = 0  # tokens of finished calls whose lease is not released (responses being sent)
        self._closing = False
        self._planning = 0  # calls accepted and tokenizing, not yet queued: a close lets them queue and finish
        self._refuse_planned = False  # closed on an event loop's own thread: those calls cannot go on, refused
        self._draining = False
        self._ran = False  # a forward (the warm-up or a request's) has completed
        self._broken: str | None = None  # why the worker cannot go on
        self._worker: threading.Thread | None = None
        self._listeners: list[Callable] = []  # () -> the listener, or None once a weak one is gone
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
    def batch_budget(self) -> int:
        """Token budget of the next forward: ``max_batch_tokens``, or less while backing off after an
        out-of-memory batch (`dice_fast.faults.BudgetBackoff`)."""
        return self._queue.budget

    @property
    def tokens_waiting(self) -> int:
        """Tokens of queued requests not yet handed to a forward (what ``max_queue_tokens`` bounds)."""
        return self._queue.tokens_waiting + self._pending_tokens

    @property
    def tokens_held(self) -> int:
        """What ``max_queue_tokens`` bounds: `tokens_waiting` plus the tokens of finished calls whose
        lease is held (their responses are being built or sent)."""
        return self.tokens_waiting + self._held_tokens

    @property
    def requests_in_flight(self) -> int:
        """Calls in progress (leases held): being tokenized, queued, run, or their responses sent."""
        return self._in_flight

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def draining(self) -> bool:
        """Whether `drain` or `close` was called: the server is shutting down."""
        return self._draining or self._closing

    @property
    def health(self) -> tuple[str, str | None]:
        """(state, detail): "ok"; "starting" until a forward has run; "draining" after `drain` or
        `close`; "unhealthy" when the worker has stopped (detail says why). Only "ok" is ready."""
        worker = self._worker
        if self._broken is None and worker is not None and not worker.is_alive() and not self._closing:
            self._broken = "the worker thread has stopped"
        if self._broken is not None:
            return "unhealthy", self._broken
        if self._closing or self._draining:
            return "draining", "shutting down: requests in flight finish, new ones are refused"
        if not self._ran:
            return "starting", "the warm-up forward has not run yet"
        return "ok", None

    def start(self) -> None:
        """Start the worker now (idempotent); it runs a warm-up forward before any request, and
        `health` is "starting" until that has run."""
        with self._cond:
            self._start_worker(warm_up=True)

    def drain(self) -> None:
        """Say "draining" in `health` (e.g. on SIGTERM, while the server finishes the requests it has);
        `close` stops the core afterwards."""
        self._draining = True

    async def embed_documents(self, texts: Iterable[str], return_chunks: bool = False, *, lease: Lease | None = None,
                              width: int | None = None, strategy: str | None = None) -> Embeddings:
        """Encode n documents (chunked and aggregated) -> `Embeddings` with vectors (n, dim) float32,
        equal to ``encoder.encode_documents(texts)`` whatever else is in flight (and, with
        ``return_chunks``, its ``chunks`` equal to ``encode_documents(texts, return_chunks=True)``).
        lease: a `lease` to hold the call's share in (kept until released); width: the floats per vector
        the caller will return (``dimensions``; default ``dim``), for ``max_response_floats``; strategy: one
        of `dice_fast.config.STRATEGIES` for these documents (None: the encoder's), as
        ``encoder.plan(texts, strategy=...)``."""
        (out,) = await self._embed([Part(texts, "documents", None, return_chunks, strategy=strategy)], lease, width)
        return out

    async def embed_queries(self, texts: Iterable[str], *, lease: Lease | None = None,
                            width: int | None = None) -> Embeddings:
        """Encode n queries (one window each, never chunked) -> `Embeddings` with vectors (n, dim)
        float32, equal to ``encoder.encode_queries(texts)``. A query longer than the window raises
        `RequestTooLarge` naming it, or with ``auto_truncate`` is cut to it (as offline) and listed in
        ``truncated``. lease, width: as `embed_documents`."""
        (out,) = await self._embed([Part(texts, "queries", "mean")], lease, width)
        return out

    async def embed_query_and_documents(self, queries: Iterable[str] | str, documents: Iterable[str],
                                        return_chunks: bool = False, *, lease: Lease | None = None,
                                        fields: tuple[str, str] = ("query", "documents"),
                                        strategy: str | None = None,
                                        numbers_per_document: int | None = None) -> tuple[Embeddings, Embeddings]:
        """(`embed_queries` of ``queries``, `embed_documents` of ``documents``) as one call: one share,
        queries tokenized first (refused: the documents are never tokenized), one check of the
        limits and the queue bound for both, and the first to fail cancels the other's unrun chunks.
        queries: a list, or one str (one query, named ``fields[0]`` in errors rather than
        ``fields[0][0]``: a field holding one string); fields: the names of the two parts in errors.
        numbers_per_document: when given, the caller returns that many numbers per document and no
        vectors (``/v1/evidence``'s rows): that is what counts against ``max_response_floats``, and the
        vectors, chunk vectors included, are only for the caller's own use (its scoring)."""
        scalar = isinstance(queries, str)
        rows = numbers_per_document is not None
        return tuple(await self._embed([Part([queries] if scalar else queries, "queries", "mean", False, fields[0],
                                             scalar=scalar, numbers=0 if rows else None),
                                        Part(documents, "documents", None, return_chunks, fields[1], strategy,
                                             numbers=numbers_per_document)],
                                       lease, None))

    def add_batch_listener(self, listener: Callable[[BatchStats], None], *, weak: bool = False) -> None:
        """Call ``listener(stats)`` from the worker thread after every forward (e.g. for metrics).
        ``weak``: ``listener`` is a bound method held weakly, dropped once its object is gone (an app's
        metrics on a core that outlives the app)."""
        ref = weakref.WeakMethod(listener) if weak else (lambda: listener)
        self._listeners.append(ref)

    def retry_after(self) -> int:
        """Seconds until the tokens now waiting have likely run (at least 1), from recent throughput."""
        if not self._rate:
            return 1
        return min(60, max(1, math.ceil(self.tokens_waiting / self._rate)))

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new requests (`ShuttingDown`), let the queued ones and those still tokenizing finish, and
        stop the worker, waiting up to ``timeout`` seconds (None: as long as it takes); whether the worker
        has stopped. Called on a thread running an event loop (use `aclose` there), calls still tokenizing
        are refused: their loop is blocked here and could never queue them."""
        try:
            asyncio.get_running_loop()
            on_a_loop = True
        except RuntimeError:
            on_a_loop = False
        with self._cond:
            self._closing = True
            self._refuse_planned = self._refuse_planned or on_a_loop
            if self._planning and not self._refuse_planned:  # calls accepted before the close: a worker for them
                self._start_worker(warm_up=False)
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
        return worker is None or not worker.is_alive()

    async def aclose(self, timeout: float | None = None) -> bool:
        """`close` without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, self.close, timeout)

    async def __aenter__(self) -> AsyncDiceEncoder:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (f"AsyncDiceEncoder({self.encoder!r}, max_inputs_per_request={self.max_inputs_per_request}, "
                f"max_input_chars={self.max_input_chars}, max_tokens_per_document={self.max_tokens_per_document}, "
                f"max_queue_tokens={self.max_queue_tokens}, max_concurrent_requests={self.max_concurrent_requests}, "
                f"request_timeout={self.request_timeout:g}, max_response_floats={self.max_response_floats}, "
                f"max_batch_tokens={self.max_batch_tokens}, "
                f"auto_truncate={self.auto_truncate}, "
                f"cross_request_batching={self.cross_request_batching}, cache_memory_mb={self.cache_memory_mb})")
