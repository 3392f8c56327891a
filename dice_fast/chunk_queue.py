"""Batching across callers: the chunks of many encoding plans, packed first-in first-out under one
token budget, and each plan's document vectors handed back when its last chunk is pooled.

    queue = ChunkQueue(encoder)
    job = queue.submit(encoder.plan(texts))          # any number of plans, from any thread
    while (batch := queue.next_batch()) is not None:  # one thread runs the model
        for done in queue.complete(batch, encoder.run_batch(batch.packed)):
            done.documents                            # (n_docs, dim) float32, row i is the plan's text i

The streaming engine submits windows of a corpus; the server submits requests, so documents of
several requests share one forward and a long document's chunks may span batches. A job's vectors do
not depend on what else was in its batches (attention is block-diagonal, pooling per chunk).
`cancel` drops a job's chunks that have not been handed out. Packing work per batch is proportional
to the batch, never to what is queued.

Faults stay small (`dice_fast.faults`): `run` runs a batch with out-of-memory split-and-retry and
fails only the jobs of a chunk that ran out of memory alone (``job.error`` names its document), while
the budget of the next batches backs off; `fail`, `fail_packing` and `fail_all` end jobs with an error.

Reuse (a chunk's vector depends only on its wrapped ids, see `dice_fast.reuse`), in the methods of
`dice_fast.reuse.manager.QueueReuse`: at submit every chunk is looked up in the queue's memory store,
then the encoder's persistent cache; a hit never enters a batch. A chunk identical to one queued and
not yet run (same identity, compared exactly after a key match) runs once: the copy waits, costs no
budget, and gets the vector when its original is pooled. Should the original never run (its job was
cancelled), the first copy to be handed out runs instead. New vectors go to the memory store and,
after each batch, to the persistent cache.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .chunking import EncodingPlan
from .faults import BudgetBackoff, InputOutOfMemory, release_cached_memory, run_split
from .matryoshka import truncate
from .reuse import ChunkKeys, ChunkStats, MemoryCache
from .reuse.manager import FOLLOW, RUN, QueueReuse, _Slot
from .ops import aggregate_documents
from .packing import PackedBatch, merge, pack
from .runner import to_device


@dataclass(eq=False)
class Job:
    """One submitted plan. ``documents`` (n_docs, dim) and ``chunks`` (n_chunks, dim) float32 arrays are
    set when it is done (``chunks`` only when asked for); ``tag`` is the submitter's."""

    plan: EncodingPlan
    aggregation: str
    keep_chunks: bool
    tag: Any = None
    documents: np.ndarray | None = None
    chunks: np.ndarray | None = None
    cancelled: bool = False
    error: BaseException | None = None  # why it failed (it is then cancelled and never done)
    _vectors: torch.Tensor | None = None
    _cum: np.ndarray = field(default=None, repr=False)  # cumulative wrapped tokens per chunk
    _handed: int = 0  # chunks handed out to batches
    _pooled: int = 0  # chunks pooled (batches complete in order)
    _docs_reported: int = 0
    # reuse: chunk states (RUN, FOLLOW, DONE), their keys, chunks still without a vector
    _state: np.ndarray = field(default=None, repr=False)
    _keys: ChunkKeys | None = field(default=None, repr=False)
    _left: int = 0
    _serial: int = -1  # the last batch that took chunks of this job, and their range
    _range: tuple[int, int] = (0, 0)

    @property
    def done(self) -> bool:
        return self.documents is not None

    @property
    def tokens_waiting(self) -> int:
        """Wrapped tokens of this job not yet handed to a batch."""
        return int(self._cum[-1] - (self._cum[self._handed - 1] if self._handed else 0)) if len(self._cum) else 0


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


class ChunkQueue(QueueReuse):
    """FIFO of chunks from many plans (see the module docstring). Thread-safe."""

    def __init__(self, encoder, max_batch_tokens: int | None = None, *, memory: MemoryCache | None = None,
                 stats: ChunkStats | None = None, dedup: bool = True):
        """memory: a `MemoryCache` consulted and filled (shared across calls if you pass one);
        stats: where reuse is counted (default: a new `ChunkStats`, as ``queue.stats``); the
        persistent cache is ``encoder.cache`` (a `CacheNamespace`, or None). ``dedup=False`` turns all
        reuse off (a baseline for benchmarks)."""
        self.encoder = encoder
        self.max_batch_tokens = max_batch_tokens or encoder.max_batch_tokens
        self._jobs: deque[Job] = deque()
        self._lock = threading.Lock()
        self._waiting = 0
        self._backoff = BudgetBackoff(self.max_batch_tokens)
        self.dedup = dedup
        self.memory = memory if dedup else None
        self.cache = getattr(encoder, "cache", None) if dedup else None
        self.stats = stats if stats is not None else ChunkStats()
        self._slots: dict[int, _Slot] = {}  # key -> the queued chunk identical copies wait for
        self._serial = 0
        self._unsaved: list = []  # (keys, identities, vectors tensor) computed, not yet in the persistent cache
        self._forming: Batch | None = None  # the batch `next_batch` formed last (or was forming when it raised)

    @property
    def tokens_waiting(self) -> int:
        """Wrapped tokens submitted and not yet handed to a batch (for backpressure)."""
        return self._waiting

    def submit(self, plan: EncodingPlan, aggregation: str | None = None, keep_chunks: bool = False, tag=None,
               keys: ChunkKeys | None = None) -> Job:
        """Queue ``plan``'s chunks; ``aggregation`` defaults to the encoder's (queries: their one chunk).
        ``keys``: the plan's `chunk_keys` when computed beforehand (e.g. in a worker thread) with
        `keys_for`. A job whose every chunk is known already (memory, cache) is done on return."""
        job = Job(plan, aggregation or self.encoder.config.aggregation, keep_chunks, tag)
        if plan.n_chunks == 0:  # no documents: nothing to run
            job._cum = np.zeros(0, np.int64)
            job.documents = np.zeros((0, self.encoder.dim), np.float32)
            job.chunks = job.documents.copy() if keep_chunks else None
            return job
        found = self._lookup(job, keys) if self.dedup else {}
        with self._lock:
            self._resolve(job, found)
            job._cum = np.cumsum(plan.chunk_lengths * (job._state == RUN))
            if job._left:
                self._jobs.append(job)
                self._waiting += job.tokens_waiting
                return job
            idle = not self._jobs
        job._pooled = plan.n_chunks
        self._finish(job)  # every chunk was known already
        if idle and self.cache is not None:
            self.cache.flush()
        return job

    def cancel(self, job: Job) -> None:
        """Hand out none of ``job``'s remaining chunks; it will never be done."""
        with self._lock:
            if not job.cancelled:
                job.cancelled = True
                self._waiting -= job.tokens_waiting
                self._release(job)
                job._handed = job.plan.n_chunks

    def next_batch(self) -> Batch | None:
        """The next chunks, first in first out, up to ``max_batch_tokens`` wrapped tokens (a chunk
        longer than the budget comes alone); None when nothing is waiting. Chunks known already and
        copies of chunks in the batch cost nothing (a batch may then run no chunk at all)."""
        with self._lock:
            budget = self.budget
            self._serial += 1
            batch = self._forming = Batch(None, None, [], [], serial=self._serial)
            parts = []
            for job in self._jobs:
                if job._handed >= job.plan.n_chunks:
                    continue
                base = job._cum[job._handed - 1] if job._handed else 0
                hi = int(np.searchsorted(job._cum, base + budget, side="right"))
                if hi == job._handed and not parts:
                    hi = job._handed + 1  # a chunk over the budget runs alone
                if hi == job._handed:
                    break
                lo = job._handed
                job._serial, job._range = batch.serial, (lo, hi)
                extra, cut = 0, False
                if (job._state[lo:hi] == FOLLOW).any():
                    extra, end = self._hand_out_followers(job, lo, hi, base, budget, batch, not parts)
                    hi, cut = end, end < hi
                    job._range = (lo, hi)
                    if hi == lo:
                        break
                ids = lo + np.flatnonzero(job._state[lo:hi] == RUN)
                parts.append(self._pack(job, ids))
                batch.jobs.append(job)
                batch.ranges.append((lo, hi))
                counted = int(job._cum[hi - 1] - base) if hi > lo else 0
                job._handed = hi
                self._waiting -= counted
                budget -= counted + extra
                if budget <= 0 or cut:
                    break
            if not batch.jobs:
                return None
        batch.packed, batch.part = merge(parts)
        return batch

    def complete(self, batch: Batch, vectors: torch.Tensor, lost_rows: set = frozenset()) -> list[Job]:
        """Store ``vectors`` (n_chunks_in_batch, dim) float32, the pooled chunks of ``batch`` in packing
        order; return the jobs this finishes, in submission order. Batches must complete in the order
        `next_batch` handed them out. ``lost_rows``: rows that have no vector (their jobs failed, see
        `run`): never reused, stored or handed to copies."""
        for j, job in enumerate(batch.jobs):
            rows = np.flatnonzero(batch.part == j)
            if len(rows):
                self._ensure_vectors(job, vectors.device)
                dst = to_device(batch.packed.chunk_ids[rows], vectors.device)
                job._vectors.index_copy_(0, dst, vectors[to_device(rows, vectors.device)])
                job._left -= len(rows)
            job._pooled = batch.ranges[j][1]
        self._fan_out(batch, vectors, lost_rows)
        finished = []
        for job in batch.jobs:
            if job._left == 0 and not job.cancelled and not job.done:
                self._finish(job)
                finished.append(job)
        with self._lock:
            while self._jobs and (self._jobs[0].done or self._jobs[0].cancelled):
                self._jobs.popleft()
            idle = not self._jobs
        self._save(everything=idle)
        return finished

    def documents_pooled(self, job: Job) -> int:
        """Documents of ``job`` whose chunks are all pooled and that were not counted by an earlier call."""
        done = int(np.searchsorted(job.plan.chunks.cu_doc_chunks, job._pooled, side="right")) - 1
        new, job._docs_reported = done - job._docs_reported, max(done, job._docs_reported)
        return max(new, 0)

    def _finish(self, job: Job) -> None:
        enc, plan = self.encoder, job.plan
        self._ensure_vectors(job, self._device())
        vecs = job._vectors
        cu = torch.from_numpy(plan.chunks.cu_doc_chunks).to(vecs.device)
        weights = torch.from_numpy(plan.chunk_weights).to(vecs.device)
        c = enc.config
        docs = aggregate_documents(vecs, cu, weights, job.aggregation, c.top_k, c.temperature,
                                   enc.normalize_chunks, c.normalize, impl=enc.pooling_impl)
        docs = truncate(docs, c.truncate_dim, c.normalize)  # Matryoshka: after aggregating full vectors
        if job.keep_chunks:
            out = torch.nn.functional.normalize(vecs, dim=1, eps=1e-12) if enc.normalize_chunks else vecs
            job.chunks = truncate(out, c.truncate_dim, enc.normalize_chunks).cpu().numpy()
        job._vectors = None
        job.documents = docs.cpu().numpy()

    # ------------------------------------------------------------------ faults (see dice_fast.faults)
    @property
    def budget(self) -> int:
        """Token budget of the next batch: ``max_batch_tokens``, or less while backing off after an
        out-of-memory batch (`dice_fast.faults.BudgetBackoff`)."""
        return self._backoff.budget

    def run(self, batch: Batch, run_batch) -> tuple[list[Job], list[Job]]:
        """Run ``batch`` with ``run_batch`` (PackedBatch -> (n, dim) float32), splitting it on
        out-of-memory down to single chunks, and complete it. Returns (jobs finished, jobs failed): a
        job fails when one of its chunks ran out of memory alone (``job.error``, an `InputOutOfMemory`
        naming its document within the plan); every other chunk keeps its exact vector. Other errors
        of ``run_batch`` propagate (the caller fails the batch's jobs). The consumer of `next_batch`
        calls this from one thread."""
        device = self._device()
        ooms = []

        def on_oom():
            ooms.append(1)
            release_cached_memory(device)

        vectors, failed = run_split(run_batch, batch.packed, self.encoder.spec.hidden_size, on_oom)  # full width
        self._backoff.failed() if ooms else self._backoff.succeeded()
        failed_jobs = []

        def fail(job, chunk: int, cause: str) -> None:
            if job.error is None and not job.cancelled:
                document = int(job.plan.chunks.document[chunk])
                self.fail(job, InputOutOfMemory(document, int(job.plan.chunk_lengths[chunk]), cause))
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
        return self.complete(batch, vectors, lost_rows=set(failed)), failed_jobs

    def fail(self, job: Job, error: BaseException) -> None:
        """End ``job`` with ``error`` (kept in ``job.error`` unless it has one): its chunks not handed
        out are dropped and it will never be done."""
        if job.error is None:
            job.error = error
        self.cancel(job)

    def _pack(self, job: Job, ids: np.ndarray) -> PackedBatch:
        """`pack` ``job``'s chunks ``ids``; an error raised names the job (for `fail_packing`)."""
        p = job.plan
        try:
            return pack(p.tokens, p.chunks, ids, p.prefix, p.suffix, self.encoder.spec.first_position,
                        p.global_positions)
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
            self._withdraw_copies(self._forming)
            touched = [job for job in self._jobs if not job.cancelled and job._handed > job._pooled]
            if culprit is not None:
                for job in touched:
                    self._waiting += int(job._cum[job._handed - 1] - (job._cum[job._pooled - 1] if job._pooled else 0))
                    job._handed = job._pooled
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
