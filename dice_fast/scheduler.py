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

Reuse (a chunk's vector depends only on its wrapped ids, see `dice_fast.reuse`), in the methods of
`dice_fast.scheduler_reuse.QueueReuse`: at submit every chunk is looked up in the queue's memory store,
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
from .reuse import ChunkKeys, ChunkStats, MemoryCache
from .scheduler_reuse import FOLLOW, RUN, QueueReuse, _Slot
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
        self.dedup = dedup
        self.memory = memory if dedup else None
        self.cache = getattr(encoder, "cache", None) if dedup else None
        self.stats = stats if stats is not None else ChunkStats()
        self._slots: dict[int, _Slot] = {}  # key -> the queued chunk identical copies wait for
        self._serial = 0
        self._unsaved: list = []  # (keys, identities, vectors tensor) computed, not yet in the persistent cache

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
            budget = self.max_batch_tokens
            self._serial += 1
            batch = Batch(None, None, [], [], serial=self._serial)
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
                p = job.plan
                parts.append(pack(p.tokens, p.chunks, ids, p.prefix, p.suffix, self.encoder.spec.first_position,
                                  p.global_positions))
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

    def complete(self, batch: Batch, vectors: torch.Tensor) -> list[Job]:
        """Store ``vectors`` (n_chunks_in_batch, dim) float32, the pooled chunks of ``batch`` in packing
        order; return the jobs this finishes, in submission order. Batches must complete in the order
        `next_batch` handed them out."""
        for j, job in enumerate(batch.jobs):
            rows = np.flatnonzero(batch.part == j)
            if len(rows):
                self._ensure_vectors(job, vectors.device)
                dst = to_device(batch.packed.chunk_ids[rows], vectors.device)
                job._vectors.index_copy_(0, dst, vectors[to_device(rows, vectors.device)])
                job._left -= len(rows)
            job._pooled = batch.ranges[j][1]
        self._fan_out(batch, vectors)
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
        if job.keep_chunks:
            out = torch.nn.functional.normalize(vecs, dim=1, eps=1e-12) if enc.normalize_chunks else vecs
            job.chunks = out.cpu().numpy()
        job._vectors = None
        job.documents = docs.cpu().numpy()
