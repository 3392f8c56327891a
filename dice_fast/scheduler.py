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

Reuse (a chunk's vector depends only on its wrapped ids, see `dice_fast.chunk_cache`): at submit every
chunk is looked up in the queue's memory store, then the encoder's persistent cache (`_resolve`); a hit
never enters a batch. A chunk identical to one queued and not yet run (same identity, compared
exactly after a key match) runs once: the copy waits, costs no budget, and gets the vector when its
original is pooled (`_hand_out_followers`, `_fan_out`). Should the original never run (its job was
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

from .chunk_cache import ChunkKeys, ChunkStats, MemoryCache, chunk_keys
from .chunking import EncodingPlan
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


RUN, FOLLOW, DONE = 0, 1, 2  # a chunk runs, waits for an identical chunk's vector, or has its vector


@dataclass(eq=False)
class _Slot:
    """A chunk queued to run that identical chunks wait for: its owner (job, chunk), copies waiting,
    and once run its vector (tensor, row) while copies still wait for it."""

    job: Job
    chunk: int
    waiting: int = 0
    vector: tuple | None = None
    serial: int = -1  # set when a copy took over: the batch it runs in


class ChunkQueue:
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

    def keys_for(self, plan: EncodingPlan) -> ChunkKeys | None:
        """`chunk_keys` of ``plan`` as this queue keys chunks (None when reuse is off); thread-safe, so
        a producer may compute them ahead and pass them to `submit`."""
        if not self.dedup:
            return None
        return chunk_keys(plan, self.cache.salt if self.cache is not None else b"")

    def flush(self) -> None:
        """Write every vector computed so far (and the recency of cache hits) to the persistent cache."""
        self._save(everything=True)

    # ------------------------------------------------------------------------------ reuse
    def _lookup(self, job: Job, keys: ChunkKeys | None) -> dict:
        """Chunks of ``job`` known already: {chunk: (tensor, row) from memory or (dim,) float32 from disk}."""
        keys = job._keys = keys if keys is not None else self.keys_for(job.plan)
        todo = np.flatnonzero(~keys.empty).tolist()
        klist = keys.keys.tolist()
        found = {}
        if self.memory is not None and todo:
            rest = []
            for c in todo:
                hit = self.memory.get(klist[c], keys.messages[c])
                if hit is None:
                    rest.append(c)
                else:
                    found[c] = hit
            self.stats.add(memory_hits=len(todo) - len(rest), memory_misses=len(rest))
            todo = rest
        if self.cache is not None and todo:
            got, damaged = self.cache.get([klist[c] for c in todo], [keys.identity(c) for c in todo])
            for i, v in got.items():
                found[todo[i]] = v
            self.stats.add(disk_hits=len(got), disk_misses=len(todo) - len(got), damaged=damaged)
        return found

    def _resolve(self, job: Job, found: dict) -> None:
        """Set every chunk's state: DONE (no tokens, or ``found``: filled now), FOLLOW (an identical
        chunk is queued: wait for it) or RUN (registered for copies to come). Called with the lock held."""
        plan = job.plan
        state = np.full(plan.n_chunks, RUN, np.int8)
        state[plan.chunk_lengths == 0] = DONE
        if found:
            device = self._device()
            self._ensure_vectors(job, device)
            mem = [(c, v) for c, v in found.items() if isinstance(v, tuple)]
            disk = [(c, v) for c, v in found.items() if not isinstance(v, tuple)]
            if mem:
                rows = torch.stack([t[r] for _, (t, r) in mem]).to(device=device, dtype=torch.float32)
                job._vectors.index_copy_(0, torch.tensor([c for c, _ in mem], device=device), rows)
            if disk:
                rows = torch.from_numpy(np.stack([v for _, v in disk])).to(device)
                job._vectors.index_copy_(0, torch.tensor([c for c, _ in disk], device=device), rows)
            state[list(found)] = DONE
        if job._keys is not None:
            klist, messages = job._keys.keys.tolist(), job._keys.messages
            for c in np.flatnonzero(state == RUN).tolist():
                k = klist[c]
                slot = self._slots.get(k)
                if slot is None:
                    self._slots[k] = _Slot(job, c)
                elif slot.job._keys.messages[slot.chunk] == messages[c]:
                    state[c] = FOLLOW
                    slot.waiting += 1
                # else: another chunk under the same 64-bit key (a collision): it simply runs
        job._state = state
        job._left = int((state != DONE).sum())

    def _hand_out_followers(self, job: Job, lo: int, hi: int, base: int, budget: int, batch: Batch,
                            first: bool) -> tuple[int, int]:
        """Resolve the copies among chunks [lo, hi) of ``job`` being handed to ``batch``: from their
        original's vector (run already), as a copy of an original in this batch (`_fan_out`), or, when
        the original will not run (cancelled), by running themselves within the budget (the range is
        cut before one that does not fit). Returns (tokens of the copies run instead, the new hi)."""
        keys = job._keys.keys
        lengths = job.plan.chunk_lengths
        extra = 0
        for c in (lo + np.flatnonzero(job._state[lo:hi] == FOLLOW)).tolist():
            k = int(keys[c])
            slot = self._slots.get(k)
            if slot is not None and slot.vector is not None:  # its original ran in an earlier batch
                t, r = slot.vector
                self._ensure_vectors(job, t.device)
                job._vectors[c] = t[r]
                job._left -= 1
                job._state[c] = DONE
                self.stats.add(deduplicated=1)
                self._waited(k, slot)
            elif slot is not None and (slot.serial == batch.serial or (
                    slot.job._serial == batch.serial and slot.job._range[0] <= slot.chunk < slot.job._range[1]
                    and slot.job._state[slot.chunk] == RUN)):  # its original runs in this batch
                batch.fan_out.append((job, c, slot.job, slot.chunk))
                job._state[c] = DONE
                self._waited(k, slot)
            else:  # the original will not run (its job was cancelled): run this copy instead
                before = int(job._cum[c - 1] - base) if c > lo else 0
                if before + extra + int(lengths[c]) > budget and not (first and before == 0 and not extra):
                    return extra, c
                extra += int(lengths[c])
                job._state[c] = RUN
                if slot is not None:
                    slot.job, slot.chunk, slot.serial = job, c, batch.serial
                    slot.waiting -= 1
        return extra, hi

    def _waited(self, key: int, slot: _Slot) -> None:
        """One copy fewer waits for ``slot``; forget it when nobody else will ask."""
        slot.waiting -= 1
        if slot.waiting <= 0 and (slot.vector is not None or slot.job.cancelled):
            self._slots.pop(key, None)

    def _release(self, job: Job) -> None:
        """Forget ``job``'s part in the registry (it is being cancelled; lock held): its copies stop
        waiting, and originals nobody waits for are dropped (those with copies waiting stay, so that
        the first copy handed out runs in their place)."""
        if job._keys is None or job._state is None:
            return
        klist = job._keys.keys.tolist()
        for c in np.flatnonzero(job._state != DONE).tolist():
            k = klist[c]
            slot = self._slots.get(k)
            if slot is None:
                continue
            if job._state[c] == FOLLOW and c >= job._handed:
                slot.waiting -= 1
            if slot.waiting <= 0 and (slot.job.cancelled or slot.vector is not None):
                del self._slots[k]

    def _fan_out(self, batch: Batch, vectors: torch.Tensor) -> None:
        """After a batch: copies in it get their original's vector; originals with copies still waiting
        keep theirs; new vectors go to the memory store and (later, `_save`) the persistent cache."""
        for job, c, src, o in batch.fan_out:
            self._ensure_vectors(job, vectors.device)
            job._vectors[c] = src._vectors[o]
            job._left -= 1
        n = len(batch.packed.chunk_ids)
        self.stats.add(computed=n, deduplicated=len(batch.fan_out))
        if not self.dedup or n == 0:
            return
        chunk_ids, part = batch.packed.chunk_ids.tolist(), batch.part.tolist()
        keys, idents = [], []
        with self._lock:
            for i, (c, j) in enumerate(zip(chunk_ids, part)):
                job = batch.jobs[j]
                k = int(job._keys.keys[c])
                slot = self._slots.get(k)
                if slot is not None and slot.job is job and slot.chunk == c:
                    if slot.waiting > 0:
                        slot.vector = (vectors, i)
                    else:
                        del self._slots[k]
                message = job._keys.messages[c]
                if self.memory is not None:
                    self.memory.put(k, message, vectors, i)
                if self.cache is not None:
                    keys.append(k)
                    idents.append(job._keys.identity(c))
        if self.cache is not None:
            self._unsaved.append((keys, idents, vectors))

    def _save(self, everything: bool) -> None:
        """Write computed vectors to the persistent cache: all but the latest batch's (so that a GPU
        batch is copied to the host after the next one has been queued), or ``everything``."""
        if self.cache is None:
            return
        todo = self._unsaved if everything else self._unsaved[:-1]
        self._unsaved = [] if everything else self._unsaved[-1:]
        for keys, idents, vectors in todo:
            written = self.cache.put(keys, idents, vectors.detach().float().cpu().numpy())
            self.stats.add(written=written)
        if everything:
            self.cache.flush()

    def _ensure_vectors(self, job: Job, device) -> None:
        if job._vectors is None:
            job._vectors = torch.zeros((job.plan.n_chunks, self.encoder.dim), dtype=torch.float32, device=device)

    def _device(self) -> torch.device:
        return torch.device(getattr(self.encoder, "device", None) or "cpu")

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
