"""Batching across callers: the chunks of many encoding plans, packed first-in first-out under one
token budget, and each plan's document vectors handed back when its last chunk is pooled.

    queue = ChunkQueue(settings, runner, reuse)      # or encoder.chunk_queue()
    job = queue.submit(encoder.plan(texts))          # any number of plans, from any thread
    while (batch := queue.next_batch()) is not None:  # one thread runs the model and its head
        for done in queue.run(batch)[0]:
            done.documents                            # (n_docs, dim) float32, row i is the plan's text i

The engine submits windows of a corpus, the server requests: documents of several requests share a
forward, a long document's chunks may span batches, and a job's vectors never depend on what else
ran beside them (block-diagonal attention, pooling per chunk). `cancel` drops a job's chunks not
handed out. Packing costs what the batch holds, never what is queued.

Faults stay small (`dice_fast.faults`): `run` runs a batch with out-of-memory split-and-retry and
fails only the jobs of a chunk that ran out of memory alone (``job.error`` names its document), while
the budget of the next batches backs off; `fail`, `fail_packing` and `fail_all` end jobs with an error.

Reuse (a chunk's vector depends only on its identity, see `dice_fast.reuse`) is the queue's
`dice_fast.reuse.manager.ChunkReuse`, called through its interface: at submit every chunk is looked
up in the queue's memory store, then the persistent cache; a hit never enters a batch. A chunk
identical to one queued and not yet run runs once: the copy waits, costs no budget, and gets the
vector when its original is pooled (or runs itself, should its original's job be cancelled). New
vectors go to the memory store and, after each batch, to the persistent cache. A finished job's
chunk vectors become its document vectors in the aggregation stage (`dice_fast.aggregation`).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .aggregation import aggregate
from .chunking import EncodingPlan
from .errors import InputOutOfMemory
from .faults import BudgetBackoff, release_cached_memory, run_split
from .head import with_head
from .packing import PackedBatch, merge, pack_plan
from .reuse import ChunkKeys, ChunkStats
from .reuse.manager import FOLLOW, RUN, ChunkReuse
from .runner import ModelRunner, to_device
from .settings import Settings


@dataclass(eq=False)
class Job:
    """One submitted plan: ``documents`` (n_docs, dim), ``chunks`` (n_chunks, dim, if asked) float32 when done.

    The fields after ``error`` are the queue's record of the plan, shared with its `ChunkReuse`, read-only
    for anyone else (``tag`` is the submitter's): ``vectors`` (n_chunks, width) float32 on ``device`` as
    they arrive, ``cum`` cumulative tokens of the chunks that run, ``handed`` / ``pooled`` chunks handed
    out / pooled, ``state`` each chunk's RUN / FOLLOW / DONE, ``keys`` its `ChunkKeys` (None: no reuse),
    ``left`` chunks still without a vector, ``serial`` / ``range`` the last batch that took chunks of it
    and their [lo, hi)."""

    plan: EncodingPlan
    aggregation: str
    keep_chunks: bool
    tag: Any = None
    documents: np.ndarray | None = None
    chunks: np.ndarray | None = None
    cancelled: bool = False
    error: BaseException | None = None  # why it failed (it is then cancelled and never done)
    width: int = 0  # of the pooled chunk vectors (the model's hidden size; truncate_dim applies after)
    device: torch.device = field(default=None, repr=False)
    vectors: torch.Tensor | None = field(default=None, repr=False)
    cum: np.ndarray = field(default=None, repr=False)
    handed: int = 0
    pooled: int = 0
    state: np.ndarray = field(default=None, repr=False)
    keys: ChunkKeys | None = field(default=None, repr=False)
    left: int = 0
    serial: int = -1
    range: tuple[int, int] = (0, 0)
    docs_reported: int = 0  # documents `ChunkQueue.documents_pooled` counted

    @property
    def done(self) -> bool:
        return self.documents is not None

    def vectors_on(self, device) -> torch.Tensor:
        """``vectors``, allocated (zeros) on ``device`` when there are none yet."""
        if self.vectors is None:
            self.vectors = torch.zeros((self.plan.n_chunks, self.width), dtype=torch.float32, device=device)
        return self.vectors

    @property
    def tokens_waiting(self) -> int:
        """Wrapped tokens of this job not yet handed to a batch."""
        return int(self.cum[-1] - (self.cum[self.handed - 1] if self.handed else 0)) if len(self.cum) else 0


@dataclass
class Batch:
    """A packed batch and where its chunks came from: chunk i is chunk ``packed.chunk_ids[i]`` of
    ``jobs[part[i]]``; ``ranges[j]`` is the [lo, hi) of chunks of ``jobs[j]`` this batch covers."""

    packed: PackedBatch
    part: np.ndarray
    jobs: list[Job]
    ranges: list[tuple[int, int]]
    fan_out: list = field(default_factory=list)  # (job, chunk, from job, from chunk): copies in this batch
    serial: int = 0
    # for `formed_as_now`: its budget, whether it took all that was queued, the queue's (submits, cancels)
    budget, dry, marks = 0, False, (0, 0)
    pending: list = field(default_factory=list)  # (job, chunk, slot): copies of originals in a batch still running
    took_over: list = field(default_factory=list)  # (job, chunk, slot, its owner before): copies run in its place
    picks: list = field(default_factory=list)  # (job, chunk ids) chosen, until packed


class ChunkQueue:
    """FIFO of chunks from many plans (see the module docstring). Thread-safe."""

    def __init__(self, settings: Settings, runner: ModelRunner | None = None, reuse: ChunkReuse | None = None,
                 max_batch_tokens: int | None = None):
        """settings: the encoder's resolved `Settings`; runner: runs a batch in `run` when no other
        ``run_batch`` is given; reuse: the `ChunkReuse` consulted and filled (default: reuse within the
        queue only, no memory store or persistent cache); max_batch_tokens: the token budget of a batch
        (default: the settings')."""
        self.settings, self.runner = settings, runner
        self.reuse = reuse if reuse is not None else ChunkReuse()
        self.max_batch_tokens = max_batch_tokens or settings.max_batch_tokens
        self._jobs: deque[Job] = deque()
        self._lock = threading.Lock()
        self._waiting = 0
        self._backoff = BudgetBackoff(self.max_batch_tokens)
        self._serial = 0
        self._submits = self._cancels = 0  # jobs queued / cancelled so far (see `formed_as_now`)
        self._forming: Batch | None = None  # the batch `next_batch` formed last (or was forming when it raised)

    @property
    def stats(self) -> ChunkStats:
        """Where this queue's reuse is counted."""
        return self.reuse.stats

    def keys_for(self, plan: EncodingPlan) -> ChunkKeys | None:
        """`ChunkReuse.keys_for`: the plan's chunk keys, computed in any thread ahead of `submit`."""
        return self.reuse.keys_for(plan)

    def flush(self) -> None:
        """Write every vector computed so far (and the recency of cache hits) to the persistent cache."""
        self.reuse.flush()

    @property
    def tokens_waiting(self) -> int:
        """Wrapped tokens submitted and not yet handed to a batch (for backpressure)."""
        return self._waiting

    def submit(self, plan: EncodingPlan, aggregation: str | None = None, keep_chunks: bool = False, tag=None,
               keys: ChunkKeys | None = None) -> Job:
        """Queue ``plan``'s chunks; ``aggregation`` defaults to the settings' (queries: their one chunk).
        ``keys``: the plan's `chunk_keys` when computed beforehand (e.g. in a worker thread) with
        `keys_for`. A job whose every chunk is known already (memory, cache) is done on return."""
        s = self.settings
        job = Job(plan, aggregation or s.config.aggregation, keep_chunks, tag, width=s.chunk_dim, device=s.device)
        if plan.n_chunks == 0:  # no documents: nothing to run
            job.cum = np.zeros(0, np.int64)
            job.documents = np.zeros((0, s.dim), np.float32)
            job.chunks = job.documents.copy() if keep_chunks else None
            return job
        found = self.reuse.look_up(job, keys) if self.reuse.enabled else {}
        with self._lock:
            self.reuse.register(job, found)
            job.cum = np.cumsum(plan.batch_costs(job.state == RUN))
            if job.left:
                self._jobs.append(job)
                self._submits += 1
                self._waiting += job.tokens_waiting
                return job
            idle = not self._jobs
        job.pooled = plan.n_chunks
        self._finish(job)  # every chunk was known already
        if idle:
            self.reuse.flush_cache()
        return job

    def cancel(self, job: Job) -> None:
        """Hand out none of ``job``'s remaining chunks; it will never be done."""
        with self._lock:
            if not job.cancelled:
                job.cancelled = True
                self._cancels += 1
                self._waiting -= job.tokens_waiting
                self.reuse.release(job)
                job.handed = job.plan.n_chunks

    def next_batch(self) -> Batch | None:
        """The next chunks, first in first out, up to ``max_batch_tokens`` wrapped tokens (a chunk
        longer than the budget comes alone); None when nothing is waiting. Chunks known already and
        copies of chunks in the batch cost nothing (a batch may then run no chunk at all)."""
        batch = self.select_batch()
        return None if batch is None else self.pack_batch(batch)

    def select_batch(self) -> Batch | None:
        """`next_batch`'s choice of chunks (the queue's bookkeeping, under its lock), not packed yet:
        `pack_batch` packs it (in any thread). A producer may select the next batch while the one
        before runs (`dice_fast.pipeline`), never while it completes."""
        with self._lock:
            budget = self.budget
            self._serial += 1
            batch = self._forming = Batch(None, None, [], [], serial=self._serial)
            batch.budget, batch.marks = budget, (self._submits, self._cancels)
            dry = True
            for job in self._jobs:
                if job.handed >= job.plan.n_chunks:
                    continue
                base = job.cum[job.handed - 1] if job.handed else 0
                hi = int(np.searchsorted(job.cum, base + budget, side="right"))
                if hi == job.handed and not batch.picks:
                    hi = job.handed + 1  # a chunk over the budget runs alone
                    if job.plan.windows is not None:  # late chunking: with the rest of its window
                        hi = int(np.searchsorted(job.cum, job.cum[job.handed], side="right"))
                if hi == job.handed:
                    dry = False
                    break
                lo = job.handed
                job.serial, job.range = batch.serial, (lo, hi)
                extra, cut = 0, False
                if (job.state[lo:hi] == FOLLOW).any():
                    extra, end = self.reuse.hand_out(job, lo, hi, base, budget, batch, not batch.picks)
                    hi, cut = end, end < hi
                    job.range = (lo, hi)
                    if hi == lo:
                        dry = False
                        break
                batch.picks.append((job, lo + np.flatnonzero(job.state[lo:hi] == RUN)))
                batch.jobs.append(job)
                batch.ranges.append((lo, hi))
                counted = int(job.cum[hi - 1] - base) if hi > lo else 0
                job.handed = hi
                self._waiting -= counted
                budget -= counted + extra
                if budget <= 0 or cut:
                    dry = False
                    break
            batch.dry = dry
            return batch if batch.jobs else None

    def pack_batch(self, batch: Batch) -> Batch:
        """Pack the chunks `select_batch` chose for ``batch`` (its ``packed`` and ``part``); returns it."""
        batch.packed, batch.part = merge([self._pack(job, ids) for job, ids in batch.picks])
        batch.picks = []
        return batch

    def formed_as_now(self, batch: Batch) -> bool:
        """Whether `select_batch`, called now, would choose ``batch``'s chunks (``batch`` was selected
        early, while the batch before it ran, which has completed since): the budget is the same,
        nothing was cancelled, and no plan was queued since, should it have taken everything queued."""
        submits, cancels = batch.marks
        return batch.budget == self.budget and cancels == self._cancels and not (batch.dry and submits != self._submits)

    def give_back(self, batch: Batch) -> None:
        """Undo the selection of ``batch``, the last selected, every batch before it completed: its
        chunks wait to be selected again (by the next `select_batch`, as if it had never been formed)."""
        with self._lock:
            self.reuse.withdraw(batch, take_overs=True)
            for job, (lo, hi) in zip(batch.jobs, batch.ranges):
                if not job.cancelled:
                    self._waiting += int(job.cum[hi - 1] - (job.cum[lo - 1] if lo else 0)) if hi > lo else 0
                    job.handed = lo

    def complete(self, batch: Batch, vectors: torch.Tensor, lost_rows: set = frozenset()) -> list[Job]:
        """Store ``vectors`` (n_chunks_in_batch, dim) float32, the pooled chunks of ``batch`` in packing
        order; return the jobs this finishes, in submission order. Batches must complete in the order
        `next_batch` handed them out. ``lost_rows``: rows that have no vector (their jobs failed, see
        `run`): never reused, stored or handed to copies."""
        # rows grouped by job in one sort and two host-to-device copies per batch, not two per job
        order = np.argsort(batch.part, kind="stable")
        bounds = np.searchsorted(batch.part[order], np.arange(len(batch.jobs) + 1)).tolist()
        ids = batch.packed.chunk_ids[order]
        if (len(batch.jobs) == 1 and batch.jobs[0].vectors is None and len(ids) == batch.jobs[0].plan.n_chunks
                and (ids == np.arange(len(ids))).all()):
            batch.jobs[0].vectors = vectors  # every chunk of one job, in its order (a query, a short document)
        elif len(order):
            dst = to_device(ids, vectors.device)
            src = vectors if len(batch.jobs) == 1 else vectors[to_device(order, vectors.device)]
        for j, job in enumerate(batch.jobs):
            lo, hi = bounds[j], bounds[j + 1]
            if hi > lo and job.vectors is not vectors:
                job.vectors_on(vectors.device).index_copy_(0, dst[lo:hi], src[lo:hi])
            job.left -= hi - lo
            job.pooled = batch.ranges[j][1]
        self.reuse.fan_out(batch, vectors, lost_rows)
        finished = []
        for job in batch.jobs:
            if job.left == 0 and not job.cancelled and not job.done:
                self._finish(job)
                finished.append(job)
        with self._lock:
            while self._jobs and (self._jobs[0].done or self._jobs[0].cancelled):
                self._jobs.popleft()
            idle = not self._jobs
        self.reuse.save(everything=idle)
        return finished

    def documents_pooled(self, job: Job) -> int:
        """Documents of ``job`` whose chunks are all pooled and that were not counted by an earlier call."""
        done = int(np.searchsorted(job.plan.chunks.cu_doc_chunks, job.pooled, side="right")) - 1
        new, job.docs_reported = done - job.docs_reported, max(done, job.docs_reported)
        return max(new, 0)

    def _finish(self, job: Job) -> None:
        """``job``'s documents (and chunks when kept) from its chunk vectors: the aggregation stage."""
        vectors = job.vectors_on(self.settings.device)
        job.documents, job.chunks = aggregate(vectors, job.plan, job.aggregation, self.settings, job.keep_chunks)
        job.vectors = None

    # ------------------------------------------------------------------ faults (see dice_fast.faults)
    @property
    def budget(self) -> int:
        """Token budget of the next batch: ``max_batch_tokens``, or less while backing off after an
        out-of-memory batch (`dice_fast.faults.BudgetBackoff`)."""
        return self._backoff.budget

    def run(self, batch: Batch, run_batch=None, before_complete=None) -> tuple[list[Job], list[Job]]:
        """Run ``batch`` with ``run_batch`` (PackedBatch -> (n, hidden_size) float32; default: the runner's
        `ModelRunner.run`) and the model's head (`dice_fast.head`), splitting it on out-of-memory down
        to single chunks, and complete it. Returns (jobs finished, jobs failed): a
        job fails when one of its chunks ran out of memory alone (``job.error``, an `InputOutOfMemory`
        naming its document within the plan); every other chunk keeps its exact vector. Other errors
        of ``run_batch`` propagate (the caller fails the batch's jobs). The consumer of `next_batch`
        calls this from one thread; ``before_complete()``, when given, is called before the batch
        completes (the pipeline waits there for its producer's selection of the next batch)."""
        device = self.settings.device
        run_batch = with_head(run_batch or self.runner.run, self.settings.head)
        ooms = []

        def on_oom():
            ooms.append(1)
            release_cached_memory(device)

        vectors, failed = run_split(run_batch, batch.packed, self.settings.chunk_dim, on_oom)  # full width
        self._backoff.failed() if ooms else self._backoff.succeeded()
        failed_jobs = []

        def fail(job, chunk: int, cause: str) -> None:
            if job.error is None and not job.cancelled:
                document = int(job.plan.chunks.document[chunk])
                self.fail(job, InputOutOfMemory(document, int(job.plan.run_lengths[chunk]), cause))
                failed_jobs.append(job)

        lost = {}  # (job id, chunk) -> cause: the chunks without a vector
        for row, cause in sorted(failed.items()):
            job, chunk = batch.jobs[int(batch.part[row])], int(batch.packed.chunk_ids[row])
            lost[id(job), chunk] = cause
            fail(job, chunk, cause)
        if lost:  # copies of a lost chunk in this batch would get no vector either: they fail with it
            for job, c, src, o in batch.fan_out:
                if (id(src), o) in lost:
                    fail(job, c, lost[id(src), o])
            batch.fan_out = [f for f in batch.fan_out if (id(f[2]), f[3]) not in lost]
        if before_complete is not None:
            before_complete()
        return self.complete(batch, vectors, lost_rows=set(failed)), failed_jobs

    def fail(self, job: Job, error: BaseException) -> None:
        """End ``job`` with ``error`` (kept in ``job.error`` unless it has one): its chunks not handed
        out are dropped and it will never be done."""
        if job.error is None:
            job.error = error
        self.cancel(job)

    def _pack(self, job: Job, ids: np.ndarray) -> PackedBatch:
        """`pack` ``job``'s chunks ``ids``; an error raised names the job (for `fail_packing`)."""
        try:
            return pack_plan(job.plan, ids, self.settings.spec.first_position)
        except Exception as exc:
            exc.dice_fast_job = job
            raise

    def fail_packing(self, error: BaseException) -> list[Job]:
        """After `next_batch` raised ``error``: fail the job whose packing raised and hand the chunks it
        had handed out to other jobs back to the queue (they go into the next batch); if the error
        names no job, fail the jobs it had handed chunks of (batches complete before the next is
        formed, so those are the jobs with chunks handed but not pooled). Returns the failed jobs."""
        culprit = getattr(error, "dice_fast_job", None)
        with self._lock:
            self.reuse.withdraw(self._forming)
            touched = [job for job in self._jobs if not job.cancelled and job.handed > job.pooled]
            if culprit is not None:
                for job in touched:
                    self._waiting += int(job.cum[job.handed - 1] - (job.cum[job.pooled - 1] if job.pooled else 0))
                    job.handed = job.pooled
                touched = [culprit]
        for job in touched:
            self.fail(job, error)
        return touched

    def fail_all(self, error: BaseException) -> list[Job]:
        """Fail every queued job that is not done (the consumer cannot go on) and return them."""
        with self._lock:
            live = [job for job in self._jobs if not job.cancelled and not job.done]
        for job in live:
            self.fail(job, error)
        return live
