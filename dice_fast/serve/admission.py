"""The request side of `AsyncDiceEncoder`: a request's share of the core (`Lease`), its admission
(limits, tokenizing, one queue-bound check) and its wait for the worker.

A *lease* is one request's share: one of ``max_concurrent_requests`` slots from the moment it is
taken, and, once its vectors are ready, its tokens counted against ``max_queue_tokens`` until the
lease is released. The HTTP app releases it only when the last byte of the response has been
written, so a request that is being serialised or sent still costs its share; a caller of
``embed_documents`` without a lease gets one that ends with the call.

One call may hold several parts (``/v1/evidence``: its query and its documents): they are tokenized
one after another in one pass (a part refused stops the pass: the parts after it are never
tokenized), checked together against the token limits, the response budget and the queue bound,
queued together, and the first part to fail cancels the others' chunks that have not run.
Nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..chunking import check_texts
from ..output import DiceOutput
from ..chunk_queue import Job
from .errors import DeadlineExceeded, Overloaded, RequestTooLarge, ShuttingDown, Unhealthy
from .planning import check_chars, input_name, plan_request


@dataclass(frozen=True)
class Embeddings:
    """The result of one request. vectors: (n, dim) float32, row i is input i; tokens: (n,) int64
    tokens the model ran for input i (all its chunks, special tokens and prefix included); truncated:
    the indices of queries cut to the window (``auto_truncate``); chunks: with ``return_chunks``, the
    `DiceOutput` (chunk vectors and spans) equal to ``encoder.encode_documents(texts, return_chunks=True)``,
    else None."""

    vectors: np.ndarray
    tokens: np.ndarray
    truncated: tuple[int, ...] = ()
    chunks: object = None


@dataclass(frozen=True)
class Part:
    """One part of a call: ``texts`` as ``kind`` ("documents" / "queries") with ``aggregation`` (None:
    the encoder's), keeping chunk vectors when ``return_chunks``; ``field`` names it in errors, text i
    as ``field[i]``, or as ``field`` alone when ``scalar`` (a field holding one string, e.g. ``query``).

    What the caller returns of it counts against ``max_response_floats``: with ``numbers`` None, its
    vectors (``width`` floats each) and, with ``return_chunks``, its chunk vectors; with ``numbers`` n,
    n numbers per text instead (e.g. ``/v1/evidence``'s rows; its chunk vectors only feed the caller's
    scoring and are not charged)."""

    texts: object
    kind: str
    aggregation: str | None = None
    return_chunks: bool = False
    field: str = "input"
    strategy: str | None = None  # documents: one of dice_fast.config.STRATEGIES (None: the encoder's)
    scalar: bool = False
    numbers: int | None = None

    def name(self, index: int) -> str:
        """How errors name text ``index`` of this part."""
        return input_name(self.field, index, self.scalar)


@dataclass(eq=False)
class QueuedRequest:
    plan: object
    aggregation: str | None
    tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    job: Job | None = None
    keys: object = None  # the plan's chunk keys, computed off the event loop
    cancelled: bool = False
    keep_chunks: bool = False
    part: Part | None = None  # names its texts in errors (None: "input[i]")
    submitted: float = field(default_factory=time.perf_counter)

    def name(self, index: int) -> str:
        """How errors name text ``index`` of this request (e.g. an input that ran out of memory)."""
        return self.part.name(index) if self.part is not None else input_name("input", index)


class Planning:
    """One accepted call, tokenizing until its requests are queued (`AsyncDiceEncoder._planning` counts them)."""

    __slots__ = ("planning",)

    def __init__(self):
        self.planning = True


class Lease:
    """One request's share of an `AsyncDiceEncoder` (``core.lease()``): a ``max_concurrent_requests``
    slot, and the request's tokens against ``max_queue_tokens`` once its vectors are ready, until
    `release` (idempotent; also ``with core.lease() as lease: ...``)."""

    def __init__(self, core):
        self.core, self.tokens, self.released = core, 0, False

    def hold(self, tokens: int) -> None:
        """Count ``tokens`` more against the queue bound until release."""
        self.core.hold_tokens(self, tokens)

    def release(self) -> None:
        """Give the slot and the held tokens back."""
        self.core.end_lease(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RequestSide:
    """The request side of `AsyncDiceEncoder` (a base class: it shares the core's ``_cond``, ``_queue``,
    ``_pending``, limits and counters)."""

    def lease(self) -> Lease:
        """Take one request's share now: `Overloaded` when ``max_concurrent_requests`` calls are in
        progress, `ShuttingDown` / `Unhealthy` when the core takes no requests. Pass it to the
        ``embed_*`` methods (``lease=``) to keep the share past the call; release it when done."""
        self._check_accepting()
        with self._cond:
            if self._in_flight >= self.max_concurrent_requests:
                raise Overloaded(f"{self._in_flight} requests are in progress, the limit "
                                 f"(max_concurrent_requests); retry later", self.retry_after())
            self._in_flight += 1
        return Lease(self)

    def hold_tokens(self, lease: Lease, tokens: int) -> None:
        """`Lease.hold`: ``tokens`` more of ``lease`` count against ``max_queue_tokens``."""
        with self._cond:
            if not lease.released:
                lease.tokens += tokens
                self._held_tokens += tokens

    def end_lease(self, lease: Lease) -> None:
        """`Lease.release`: its slot and held tokens back (once)."""
        with self._cond:
            if not lease.released:
                lease.released = True
                self._held_tokens -= lease.tokens
                self._in_flight -= 1

    async def _embed(self, parts: list[Part], lease: Lease | None, width: int | None):
        """The `Embeddings` of each part of one call (see the module docstring)."""
        own = lease is None
        if own:
            lease = self.lease()
        elif lease.released or lease.core is not self:
            raise ValueError("the lease is released or belongs to another AsyncDiceEncoder")
        try:
            return await self._embed_parts(parts, lease, width or self.dim)
        finally:
            if own:
                lease.release()

    async def _embed_parts(self, parts: list[Part], lease: Lease, width: int):
        with self._cond:
            self._check_accepting()
            self._planning += 1  # accepted: a close from here on lets it queue its work (it was refused)
        call = Planning()
        try:
            return await self._embed_accepted(parts, lease, width, call)
        finally:
            self._planned(call)  # queued, refused or failed before

    def _planned(self, call: Planning) -> None:
        """``call`` no longer plans (its requests are queued, or it ended before): once, whatever the path."""
        with self._cond:
            if call.planning:
                call.planning = False
                self._planning -= 1
                self._cond.notify_all()  # a closing worker waits for calls still planning

    async def _embed_accepted(self, parts: list[Part], lease: Lease, width: int, call: Planning):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout if self.request_timeout else None
        texts = [check_texts(p.texts, p.field) for p in parts]
        for p, t in zip(parts, texts):
            if len(t) > self.max_inputs_per_request:
                raise RequestTooLarge(f"{len(t)} inputs in one request; the limit is {self.max_inputs_per_request} "
                                      "(max_inputs_per_request)", param=p.field)
        self._check_response(width, parts, texts, None)
        if not any(texts):
            return [Embeddings(np.zeros((0, self.dim), np.float32), np.zeros(0, np.int64)) for _ in parts]
        if self.tokens_held >= self.max_queue_tokens:  # full already: do not spend time tokenizing
            raise self._queue_full(0)
        for p, t in zip(parts, texts):
            check_chars(t, self.max_input_chars, p.field, p.scalar)
        abandoned = threading.Event()

        def plan_all():  # in one worker thread: tokenize part after part, check sizes, key the chunks
            done, before = [], 0
            for p, t in zip(parts, texts):
                if not t:
                    done.append((None, (), None))
                    continue
                check = self._size_check(p, before)
                plan, truncated = plan_request(self.encoder, t, p.kind, piece_chars=self._piece_chars,
                                               auto_truncate=self.auto_truncate, check_sizes=check,
                                               abandoned=abandoned, field=p.field, scalar=p.scalar,
                                               strategy=p.strategy if p.kind == "documents" else None)
                check(plan.document_tokens)
                before += int(plan.document_tokens.sum())
                done.append((plan, truncated, self._queue.keys_for(plan)))
            self._check_response(width, parts, texts, [0 if plan is None else plan.n_chunks for plan, _, _ in done])
            return done

        try:
            planned = await self._until(deadline, loop.run_in_executor(None, plan_all))
        except (asyncio.CancelledError, DeadlineExceeded):
            abandoned.set()  # stop tokenizing at the next piece
            raise
        requests = [None if plan is None else
                    QueuedRequest(plan, p.aggregation, int(plan.document_tokens.sum()), loop, loop.create_future(),
                             keys=keys, keep_chunks=p.return_chunks, part=p)
                    for p, (plan, _, keys) in zip(parts, planned)]
        queued = [r for r in requests if r is not None]
        self._submit(queued, call)
        try:
            await self._until(deadline, _all_or_first_error([r.future for r in queued]))
        except BaseException:
            for r in queued:  # the first error (or the client gone, or the deadline) ends the rest
                self._cancel(r)
            raise
        lease.hold(sum(r.tokens for r in queued))
        out = []
        for p, r, (plan, truncated, _) in zip(parts, requests, planned):
            if r is None:
                out.append(Embeddings(np.zeros((0, self.dim), np.float32), np.zeros(0, np.int64)))
                continue
            vectors, tokens = r.future.result(), plan.document_tokens
            if p.return_chunks:
                out.append(Embeddings(vectors[0], tokens, truncated, DiceOutput.of_plan(plan, *vectors)))
            else:
                out.append(Embeddings(vectors, tokens, truncated))
        return out

    def _check_accepting(self, accepted: bool = False) -> None:
        """`Unhealthy` or `ShuttingDown` for a new call; a call ``accepted`` before a close goes on, unless
        the close came from an event loop's own thread (no worker waited for it)."""
        if self.health[0] == "unhealthy":
            raise Unhealthy(f"the encoder cannot serve: {self._broken}")
        if self._closing and (not accepted or self._refuse_planned):
            raise ShuttingDown("the encoder is shutting down and takes no new requests")

    async def _until(self, deadline: float | None, awaitable):
        """Await ``awaitable`` until ``deadline`` (event-loop time; None: no deadline), else raise
        `DeadlineExceeded` (a future is cancelled)."""
        if deadline is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            raise DeadlineExceeded(f"the request did not finish within {self.request_timeout:g} s "
                                   "(request_timeout); its chunks that had not run were dropped") from None

    def _check_response(self, width: int, parts: list[Part], texts: list[list[str]],
                        chunks: list[int] | None) -> None:
        """`RequestTooLarge` naming the largest share when what the caller returns of ``parts`` (see
        `Part`; ``texts`` per part, ``chunks`` the chunks per part, None before tokenizing) passes
        ``max_response_floats``, with vectors of ``width`` floats."""
        inputs = chunked = 0
        terms, shares = [], []  # shares: (floats, field) per part
        for i, (p, t) in enumerate(zip(parts, texts)):
            if p.numbers is None:
                c = chunks[i] if chunks is not None and p.return_chunks else 0
                inputs, chunked = inputs + len(t), chunked + c
                shares.append((width * (len(t) + c), p.field))
            elif p.numbers and t:
                terms.append(f"{len(t)} {p.field} x {p.numbers} numbers")
                shares.append((p.numbers * len(t), p.field))
        floats = sum(n for n, _ in shares)
        if floats <= self.max_response_floats:
            return
        if inputs:
            terms.insert(0, f"({inputs} inputs" + (f" + {chunked} chunks" if chunked else "") + f") x {width} floats")
        param = max(reversed(shares), key=lambda share: share[0])[1]  # the largest; the later part on a tie
        fewer = "fewer inputs" + ("" if param == "input" else f" in '{param}'")
        raise RequestTooLarge(f"the response would hold {' + '.join(terms)} = {floats} floats; the limit is "
                              f"{self.max_response_floats} (max_response_floats); send {fewer}"
                              + (" or no return_chunks" if chunked else ""), param=param)

    def _size_check(self, part: Part, before: int):
        """``check(tokens, at_least=False)`` refusing ``part`` of ``tokens`` (n,) per input (``at_least``:
        lower bounds found so far) after ``before`` tokens of earlier parts."""

        def check(tokens: np.ndarray, at_least: bool = False) -> None:
            limit = self.max_tokens_per_document
            if limit and (over := np.flatnonzero(tokens > limit)).size:
                i = int(over[0])
                n = f"more than {limit}" if at_least else int(tokens[i])
                raise RequestTooLarge(f"{part.name(i)} has {n} tokens; the limit is {limit} tokens per input, special "
                                      "tokens included (max_tokens_per_document)", param=part.name(i))
            total = before + int(tokens.sum())
            if total > self.max_queue_tokens:
                n = f"more than {self.max_queue_tokens}" if at_least else total
                raise RequestTooLarge(f"the request has {n} tokens, more than the {self.max_queue_tokens} tokens the "
                                      "queue holds (max_queue_tokens); split it into smaller requests",
                                      param=part.field)

        return check

    def _queue_full(self, tokens: int) -> Overloaded:
        return Overloaded(f"the queue holds {self.tokens_held} tokens; {tokens} more would pass its limit of "
                          f"{self.max_queue_tokens} (max_queue_tokens); retry later", self.retry_after())

    def _submit(self, requests: list[QueuedRequest], call: Planning) -> None:
        """Queue ``requests`` (the parts of one call) together, or none of them."""
        tokens = sum(r.tokens for r in requests)
        with self._cond:
            self._check_accepting(accepted=True)
            held = self.tokens_held
            if held and held + tokens > self.max_queue_tokens:
                raise self._queue_full(tokens)
            self._pending.extend(requests)
            self._pending_tokens += tokens
            self._planned(call)  # queued: the pending requests keep a closing worker running now
            self._start_worker(warm_up=False)
            self._cond.notify()

    def _cancel(self, request: QueuedRequest) -> None:
        with self._cond:
            if request.future.done() and not request.future.cancelled():
                return  # finished: nothing left to drop
            request.cancelled = True
            if request.job is not None:
                self._queue.cancel(request.job)  # its chunks not handed out are dropped
            elif request in self._pending:
                self._pending.remove(request)
                self._pending_tokens -= request.tokens


async def _all_or_first_error(futures: list[asyncio.Future]) -> None:
    """Return when every future has a result; raise the first exception as soon as one fails."""
    pending = set(futures)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
