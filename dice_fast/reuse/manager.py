"""What the queue holds to reuse chunk vectors: `ChunkReuse`, the way a serving scheduler holds a
KV-cache manager. The queue calls it through a small interface and never touches its state:

    keys = reuse.keys_for(plan)                    # any thread: the plan's chunk keys (None: reuse off)
    found = reuse.look_up(job, keys)               # the memory store, then the persistent cache
    reuse.register(job, found)                     # queue lock held: every chunk RUN, FOLLOW or DONE
    extra, hi = reuse.hand_out(job, lo, hi, ...)   # queue lock held: copies among chunks handed out
    reuse.withdraw(batch)                          # the batch will not run: its copies wait again
    reuse.fan_out(batch, vectors, lost_rows)       # after a batch: copies and the stores get vectors
    reuse.save(everything)                         # computed vectors to the persistent cache
    reuse.release(job)                             # the job is cancelled: forget its part

The first of identical chunks RUNs, later copies FOLLOW it, cost no budget, and at hand-out get its
vector, join it in the same batch (`fan_out` copies the vector), or, when it will not run (its job
was cancelled), run in its place. After a batch new vectors go to the memory store and, one batch
later (`save`), to disk. ``job`` and ``batch`` are the queue's `Job` and `Batch`
(`dice_fast.chunk_queue`): their documented fields are the queue's record of a plan, shared with
this object; the registry of queued originals and the vectors not yet saved are this object's own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .keys import ChunkKeys, chunk_keys
from .memory import ChunkStats, MemoryCache
from ..scoring import finite_rows

RUN, FOLLOW, DONE = 0, 1, 2  # a chunk runs, waits for an identical chunk's vector, or has its vector


@dataclass(eq=False)
class Slot:
    """A chunk queued to run that identical chunks wait for: its owner (job, chunk), copies waiting,
    and once run its vector (tensor, row) while copies still wait for it."""

    job: object  # a chunk_queue.Job
    chunk: int
    waiting: int = 0
    vector: tuple | None = None
    serial: int = -1  # set when a copy took over: the batch it runs in


class ChunkReuse:
    """Chunk reuse for one `ChunkQueue` (see the module docstring). ``enabled=False``: no reuse at all
    (every chunk runs; a baseline); memory: a `MemoryCache` consulted and filled (None: none); cache:
    the persistent store's `CacheNamespace` (None: none); stats: where reuse is counted."""

    def __init__(self, *, memory: MemoryCache | None = None, cache=None, stats: ChunkStats | None = None,
                 enabled: bool = True):
        self.enabled = enabled
        self.memory = memory if enabled else None
        self.cache = cache if enabled else None
        self.stats = stats if stats is not None else ChunkStats()
        self._lock = threading.Lock()  # guards the registry
        self._slots: dict[int, Slot] = {}  # key -> the queued chunk identical copies wait for
        self._unsaved: list = []  # (keys, identities, vectors tensor) computed, not yet in the persistent cache

    @property
    def waiting_originals(self) -> int:
        """Queued chunks that identical copies wait for (0 once nothing is queued)."""
        return len(self._slots)

    def keys_for(self, plan) -> ChunkKeys | None:
        """`chunk_keys` of ``plan`` as this queue keys chunks (None when reuse is off); thread-safe, so
        a producer may compute them ahead and pass them to `submit`."""
        if not self.enabled:
            return None
        return chunk_keys(plan, self.cache.salt if self.cache is not None else b"")

    def flush(self) -> None:
        """Write every vector computed so far (and the recency of cache hits) to the persistent cache."""
        self.save(everything=True)

    def flush_cache(self) -> None:
        """Commit what the persistent cache holds in memory (the recency of hits), if there is one."""
        if self.cache is not None:
            self.cache.flush()

    def look_up(self, job, keys: ChunkKeys | None) -> dict:
        """Chunks of ``job`` known already: {chunk: (tensor, row) from memory or (dim,) float32 from disk}."""
        keys = job.keys = keys if keys is not None else self.keys_for(job.plan)
        todo = np.flatnonzero(job.plan.chunk_lengths).tolist()  # a chunk of no tokens has nothing to look up
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

    def register(self, job, found: dict) -> None:
        """Set every chunk's state: DONE (no tokens, or ``found``: filled now), FOLLOW (an identical
        chunk is queued: wait for it) or RUN (registered for copies to come); ``found`` as `look_up` gave
        it. The queue calls this with its lock held (so do `hand_out`, `withdraw` and `release`)."""
        plan = job.plan
        state = np.full(plan.n_chunks, RUN, np.int8)
        state[plan.chunk_lengths == 0] = DONE
        if found:
            device = job.device
            job.vectors_on(device)
            mem = [(c, v) for c, v in found.items() if isinstance(v, tuple)]
            disk = [(c, v) for c, v in found.items() if not isinstance(v, tuple)]
            if mem:
                rows = torch.stack([t[r] for _, (t, r) in mem]).to(device=device, dtype=torch.float32)
                job.vectors.index_copy_(0, torch.tensor([c for c, _ in mem], device=device), rows)
            if disk:
                rows = torch.from_numpy(np.stack([v for _, v in disk])).to(device)
                job.vectors.index_copy_(0, torch.tensor([c for c, _ in disk], device=device), rows)
            state[list(found)] = DONE
        if job.keys is not None:
            klist, messages = job.keys.keys.tolist(), job.keys.messages
            with self._lock:
                for c in np.flatnonzero(state == RUN).tolist():
                    k = klist[c]
                    slot = self._slots.get(k)
                    if slot is None:
                        self._slots[k] = Slot(job, c)
                    elif slot.job.keys.messages[slot.chunk] == messages[c]:
                        state[c] = FOLLOW
                        slot.waiting += 1
                    # else: another chunk under the same 64-bit key (a collision): it simply runs
        job.state = state
        job.left = int((state != DONE).sum())

    def hand_out(self, job, lo: int, hi: int, base: int, budget: int, batch, first: bool) -> tuple[int, int]:
        """Resolve the copies among chunks [lo, hi) of ``job`` being handed to ``batch``: from their
        original's vector (run already), as a copy of an original in this batch (`fan_out`), or, when
        the original will not run (cancelled), by running themselves within the budget. The range is cut
        before a copy that does not fit, or whose original is still queued for a later batch (it waits:
        the original's job is earlier in the queue, so the first job of a batch never waits). Returns
        (tokens of the copies run instead, the new hi)."""
        with self._lock:
            return self._hand_out(job, lo, hi, base, budget, batch, first)

    def _hand_out(self, job, lo: int, hi: int, base: int, budget: int, batch, first: bool) -> tuple[int, int]:
        """`hand_out` with the registry's lock held."""
        keys = job.keys.keys
        lengths = job.plan.run_lengths  # late chunking: a copy that runs itself runs its window
        extra = 0
        for c in (lo + np.flatnonzero(job.state[lo:hi] == FOLLOW)).tolist():
            k = int(keys[c])
            slot = self._slots.get(k)
            if slot is not None and slot.vector is not None:  # its original ran in an earlier batch
                t, r = slot.vector
                job.vectors_on(t.device)
                job.vectors[c] = t[r]
                job.left -= 1
                job.state[c] = DONE
                self.stats.add(deduplicated=1)
                self._waited(k, slot)
            elif slot is not None and (slot.serial == batch.serial or (
                    slot.job.serial == batch.serial and slot.job.range[0] <= slot.chunk < slot.job.range[1]
                    and slot.job.state[slot.chunk] == RUN)):  # its original runs in this batch
                batch.fan_out.append((job, c, slot.job, slot.chunk))
                job.state[c] = DONE
                self._waited(k, slot)
            elif slot is not None and not slot.job.cancelled and slot.job.pooled <= slot.chunk < (
                    slot.job.range[0] if slot.job.serial == batch.serial else slot.job.handed):
                # its original runs in a batch still running (a producer selects this batch early,
                # `dice_fast.pipeline`): the vector comes when this batch completes, after that one
                batch.pending.append((job, c, slot))
                job.state[c] = DONE
            elif slot is not None and not slot.job.cancelled and slot.chunk >= slot.job.handed:
                # its original is queued for a later batch (this one ran out of budget inside the
                # original's job, which comes earlier in the queue): wait for it, never run it twice
                return extra, c
            else:  # the original will not run (its job was cancelled): run this copy instead
                before = int(job.cum[c - 1] - base) if c > lo else 0
                if before + extra + int(lengths[c]) > budget and not (first and before == 0 and not extra):
                    return extra, c
                extra += int(lengths[c])
                job.state[c] = RUN
                batch.took_over.append((job, c, slot, None if slot is None else (slot.job, slot.chunk, slot.serial)))
                if slot is not None:
                    slot.job, slot.chunk, slot.serial = job, c, batch.serial
                    slot.waiting -= 1
        return extra, hi

    def withdraw(self, batch, take_overs: bool = False) -> None:
        """``batch`` will not run (packing it failed, or it was selected early and is given back): its
        copies wait for their originals again, or run themselves when those are gone (lock held).
        ``take_overs``: copies chosen to run in place of a cancelled original wait again too."""
        with self._lock:
            self._withdraw(batch, take_overs)

    def _withdraw(self, batch, take_overs: bool) -> None:
        """`withdraw` with the registry's lock held."""
        if batch is None:
            return
        for job, c, _, _ in batch.fan_out:
            if job.cancelled:  # `release` skipped it (it was DONE then): nobody will ask for this copy, so it
                continue  # must not wait again, holding its original's slot (and that batch's output) for good
            job.state[c] = FOLLOW
            slot = self._slots.get(int(job.keys.keys[c]))
            if slot is not None:
                slot.waiting += 1
        batch.fan_out.clear()
        for job, c, slot in batch.pending:  # still counted as waiting by their slot
            if job.cancelled:  # `release` skipped it (it was DONE then)
                self._waited(int(job.keys.keys[c]), slot)
            else:
                job.state[c] = FOLLOW
        batch.pending.clear()
        for job, c, slot, owner in reversed(batch.took_over if take_overs else []):
            job.state[c] = FOLLOW
            if slot is not None:
                slot.job, slot.chunk, slot.serial = owner
                slot.waiting += 1
        batch.took_over.clear()

    def _waited(self, key: int, slot: Slot) -> None:
        """One copy fewer waits for ``slot``; forget it when nobody else will ask."""
        slot.waiting -= 1
        if slot.waiting <= 0 and (slot.vector is not None or slot.job.cancelled):
            self._slots.pop(key, None)

    def release(self, job) -> None:
        """Forget ``job``'s part in the registry (it is being cancelled): its copies stop
        waiting, and originals nobody waits for are dropped (those with copies waiting stay, so that
        the first copy handed out runs in their place)."""
        with self._lock:
            self._release(job)

    def _release(self, job) -> None:
        """`release` with the registry's lock held."""
        if job.keys is None or job.state is None:
            return
        klist = job.keys.keys.tolist()
        for c in np.flatnonzero(job.state != DONE).tolist():
            k = klist[c]
            slot = self._slots.get(k)
            if slot is None:
                continue
            if job.state[c] == FOLLOW and c >= job.handed:
                slot.waiting -= 1
            if slot.waiting <= 0 and (slot.job.cancelled or slot.vector is not None):
                del self._slots[k]

    def fan_out(self, batch, vectors: torch.Tensor, lost_rows: set = frozenset()) -> None:
        """After a batch: copies in it get their original's vector; originals with copies still waiting
        keep theirs; new vectors go to the memory store and (later, `save`) the persistent cache. A row
        in ``lost_rows`` has no vector (it failed): its copies still waiting will run it themselves."""
        for job, c, src, o in batch.fan_out:
            job.vectors_on(vectors.device)
            job.vectors[c] = src.vectors[o]
            job.left -= 1
        with self._lock:
            for job, c, slot in batch.pending:  # their originals' batch completed before this one
                if slot.vector is None:  # pragma: no cover - a queue bug, never silent
                    raise RuntimeError("dice_fast: a copy's original completed without a vector")
                t, r = slot.vector
                job.vectors_on(t.device)[c] = t[r]
                job.left -= 1
                self._waited(int(job.keys.keys[c]), slot)
        self.stats.add(deduplicated=len(batch.pending))
        batch.pending.clear()
        n = len(batch.packed.chunk_ids)
        self.stats.add(computed=n, deduplicated=len(batch.fan_out))
        if not self.enabled or n == 0:
            return
        chunk_ids, part = batch.packed.chunk_ids.tolist(), batch.part.tolist()
        keys, idents, rows = [], [], []  # rows: of `vectors`, in step with keys and idents
        with self._lock:
            for i, (c, j) in enumerate(zip(chunk_ids, part)):
                if i in lost_rows:
                    continue
                job = batch.jobs[j]
                k = int(job.keys.keys[c])
                slot = self._slots.get(k)
                if slot is not None and slot.job is job and slot.chunk == c:
                    if slot.waiting > 0:
                        slot.vector = (vectors, i)
                    else:
                        del self._slots[k]
                message = job.keys.messages[c]
                if self.memory is not None:
                    self.memory.put(k, message, vectors, i)
                if self.cache is not None:
                    keys.append(k)
                    idents.append(job.keys.identity(c))
                    rows.append(i)
        if self.cache is not None:  # lost rows (zeros) are left out, so each key keeps its own vector
            self._unsaved.append((keys, idents, vectors[rows] if lost_rows else vectors))

    def save(self, everything: bool) -> None:
        """Write computed vectors to the persistent cache: all but the latest batch's (so that a GPU
        batch is copied to the host after the next one has been queued), or ``everything``."""
        if self.cache is None:
            return
        todo = self._unsaved if everything else self._unsaved[:-1]
        self._unsaved = [] if everything else self._unsaved[-1:]
        for keys, idents, vectors in todo:
            rows = vectors.detach().float().cpu().numpy()
            if not (finite := finite_rows(rows)).all():  # a model's NaN: never kept
                keep = np.flatnonzero(finite)  # (the call raises NonFiniteOutput naming the input)
                keys, idents, rows = [keys[i] for i in keep], [idents[i] for i in keep], rows[keep]
            written = self.cache.put(keys, idents, rows)
            self.stats.add(written=written)
        if everything:
            self.cache.flush()


__all__ = ["ChunkReuse", "DONE", "FOLLOW", "RUN", "Slot"]
