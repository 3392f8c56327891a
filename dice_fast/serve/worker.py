"""The worker side of `AsyncDiceEncoder`: one supervised thread that owns the model.

    admit planned requests -> ChunkQueue.next_batch -> ChunkQueue.run (forward, split on OOM) -> settle

Every step is guarded, so a fault costs only the requests it touches and the thread goes on:

* admission (``ChunkQueue.submit``) raises: that request fails;
* packing (``ChunkQueue.next_batch``) raises: the requests whose chunks it was handing out fail
  (`ChunkQueue.fail_packing`);
* the forward raises out-of-memory: the batch is split and retried, and only a request with a chunk
  that fails alone gets `OutOfMemory` naming its input; any other error of the forward or of pooling
  fails the requests of that batch which had not finished;
* a batch listener raises: it is logged.

Anything that escapes a step (or the warm-up forward failing) stops the worker: the core is marked
unhealthy with the reason, every waiting request fails with `Unhealthy`, and new ones are refused.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ..cpu_heap import release_freed_memory
from ..aggregation import non_finite_document
from ..errors import NonFiniteOutput
from ..faults import InputOutOfMemory
from .errors import ModelOutputNotFinite, OutOfMemory, Unhealthy, log_once

IDLE_TRIM_S = 1.0  # seconds without work after which a CPU worker hands its kept heap pages back
# ... and under steady load, at most this long apart: glibc keeps freed pages per thread arena (the
# worker's and each request thread's), so a server that never idles grew from 0.87 to 1.72 GiB in
# 4 minutes (soak, RESULTS §0.11) though its heap after a trim was 0.74 GiB
BUSY_TRIM_S = 10.0
WARM_UP_TEXT = "warm up"  # the query of the warm-up forward that `AsyncDiceEncoder.start` runs

log = logging.getLogger("dice_fast.serve")


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


class WorkerLoop:
    """The worker thread of `AsyncDiceEncoder` (a base class: it shares the core's ``_cond``, ``_queue``,
    ``_pending``, ``_closing``, ``_planning``, ``_refuse_planned``, ``_ran``, ``_broken`` and ``_worker``)."""

    def _start_worker(self, warm_up: bool) -> None:
        """Start the worker thread unless it runs. Called with ``_cond`` held."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._supervise, args=(warm_up,), name="dice-fast-serve-worker",
                                            daemon=True)
            self._worker.start()

    def _supervise(self, warm_up: bool) -> None:
        try:
            if warm_up:
                self._warm_up()
            self._work()
        except BaseException as exc:  # noqa: BLE001 - the worker cannot go on: say so, fail what waits
            log.critical("dice_fast.serve: the worker stopped; the encoder is unhealthy", exc_info=True)
            self._stop_broken(f"the worker stopped ({type(exc).__name__}: {exc})")

    def _stop_broken(self, reason: str) -> None:
        with self._cond:
            self._broken = reason
            error = Unhealthy(f"the encoder cannot serve: {reason}")
            waiting = list(self._pending)
            self._pending.clear()
            self._pending_tokens = 0
            waiting += [job.tag for job in self._queue.fail_all(error)]
        for request in waiting:
            _settle(request, exc=error)

    def _warm_up(self) -> None:
        """One forward of a short query through the whole path (plan, pack, model, pooling), alone
        (no reuse: a cached warm-up vector would skip the forward it exists for)."""
        queue = self.encoder.chunk_queue(dedup=False)
        job = queue.submit(self.encoder.plan([WARM_UP_TEXT], "queries"), "mean")
        while (batch := queue.next_batch()) is not None:
            queue.run(batch, self.encoder.run_batch)
        if job.error is not None:
            raise RuntimeError(f"the warm-up forward failed: {job.error}")
        self._ran = True

    def _work(self) -> None:
        busy = False  # ran a batch since the heap was last trimmed
        trimmed = time.monotonic()
        while True:
            with self._cond:
                self._admit()
                batch = self._next_batch()
                if batch is None:
                    if self._closing and not self._pending and (not self._planning or self._refuse_planned):
                        return
                    if not busy or not self._trims_heap:
                        self._cond.wait()
                        continue
                    if self._cond.wait(timeout=self.idle_trim_s):
                        continue  # woken within the quiet period: look for work again, no trim
            if batch is None:  # quiet for idle_trim_s: hand the kept activation pages back (CPU)
                busy, trimmed = False, time.monotonic()
                release_freed_memory()
                continue
            busy = True
            self._run(batch)
            if self._trims_heap and time.monotonic() - trimmed >= self.busy_trim_s:
                trimmed = time.monotonic()
                release_freed_memory()

    def _admit(self) -> None:
        """Hand planned requests to the ChunkQueue: all of them, or one at a time without cross-request
        batching. Called with ``_cond`` held, which is released around each `ChunkQueue.submit` (its
        lookups in the chunk cache read the disk, and the event loop takes ``_cond`` for every request);
        the request counts as pending meanwhile. A request whose admission raises fails alone; one
        cancelled meanwhile has its job cancelled at once."""
        while self._pending:
            if not self.cross_request_batching:
                cur = self._current
                if cur is not None and not (cur.done or cur.cancelled):
                    return
            request = self._pending.popleft()
            if request.loop.is_closed():  # its caller's event loop is gone, uncancelled: nobody will read it
                self._pending_tokens -= request.tokens
                continue
            job = error = None
            self._cond.release()
            try:
                job = self._queue.submit(request.plan, request.aggregation, tag=request,
                                         keep_chunks=request.keep_chunks, keys=request.keys)
            except Exception as exc:
                error = exc
                log_once(log, exc, "dice_fast.serve: admitting a request failed")
            finally:
                self._cond.acquire()
                self._pending_tokens -= request.tokens
            if error is not None:
                _settle(request, exc=error)
                continue
            request.job = job
            if not self.cross_request_batching:  # else it pinned the last job (its request, future and task)
                self._current = job
            if request.cancelled:  # while it was being admitted: `_cancel` found neither job nor pending
                self._queue.cancel(job)
            elif job.done:  # every chunk was in memory or the cache
                _settle_done(job, self.encoder.precision)

    def _next_batch(self):
        """`ChunkQueue.next_batch`; when packing raises, fail the requests it touched and try again.
        Called with ``_cond`` held."""
        while True:
            try:
                return self._queue.next_batch()
            except Exception as exc:
                failed = self._queue.fail_packing(exc)
                if not failed:  # nothing to blame: the queue cannot go on
                    raise
                log_once(log, exc, "dice_fast.serve: packing a batch failed; %d request(s) fail", len(failed))
                for job in failed:
                    _settle(job.tag, exc=exc)

    def _run(self, batch) -> None:
        start = time.perf_counter()
        try:
            finished, failed = self._queue.run(batch, self.encoder.run_batch)
        except Exception as exc:  # the forward or pooling failed: its unfinished requests fail, keep serving
            log_once(log, exc, "dice_fast.serve: a batch of %d tokens failed", batch.packed.n_tokens)
            with self._cond:
                for job in batch.jobs:
                    if job.done:  # finished before the error
                        _settle_done(job, self.encoder.precision)
                    elif not job.cancelled or job.error is not None:
                        self._queue.fail(job, exc)
                        _settle(job.tag, exc=_client_error(job.error, job.tag))
            return
        self._ran = True
        seconds = time.perf_counter() - start
        for job in finished:
            _settle_done(job, self.encoder.precision)
        for job in failed:
            _settle(job.tag, exc=_client_error(job.error, job.tag))
        tokens = batch.packed.n_tokens
        rate = tokens / max(seconds, 1e-6)
        self._rate = rate if self._rate is None else 0.8 * self._rate + 0.2 * rate
        stats = BatchStats(tokens, len(batch.packed.chunk_ids), len(batch.jobs), self.max_batch_tokens, seconds)
        for ref in list(self._listeners):
            listener = ref()
            if listener is None:  # held weakly, and gone
                self._listeners.remove(ref)
                continue
            try:
                listener(stats)
            except Exception:  # a broken listener must not stop the worker
                log.exception("dice_fast.serve: batch listener %r failed", listener)


def _client_error(error: BaseException, request) -> BaseException:
    """What the client of a failed ``request`` (a `QueuedRequest`) gets: `OutOfMemory` naming its input
    as the request's field names it (``documents[1]``, ``query``), else the error."""
    if isinstance(error, InputOutOfMemory):
        error = error.renamed(request.name(error.index))
        return OutOfMemory(str(error), param=error.name)
    if isinstance(error, NonFiniteOutput):
        error = error.renamed(request.name(error.index))
        return ModelOutputNotFinite(str(error), param=error.name)
    return error


def _settle_done(job, precision: str) -> None:
    """Resolve a finished job's request with its document vectors (with its chunk vectors when kept),
    or with `ModelOutputNotFinite` naming the input whose vectors are not finite."""
    if (bad := non_finite_document(job.plan, job.documents, job.chunks)) is not None:
        error = _client_error(NonFiniteOutput(bad, precision), job.tag)
        log.error("dice_fast.serve: a request failed: %s", error)  # a failure of the model: logged, as other 500s
        _settle(job.tag, exc=error)
    else:
        _settle(job.tag, value=(job.documents, job.chunks) if job.keep_chunks else job.documents)


def _settle(request, value=None, exc: BaseException | None = None) -> None:
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
