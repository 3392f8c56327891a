"""The reuse steps of `dice_fast.chunk_queue.ChunkQueue` (a mixin, so the queue's own logic stays apart).

At submit every chunk is looked up in the queue's memory store, then the encoder's persistent cache
(`_lookup`); chunks not found are registered (`_resolve`): the first of identical chunks RUNs, later
copies FOLLOW it, cost no budget, and at hand-out (`_hand_out_followers`) get its vector, join it in the
same batch (`_fan_out` copies the vector), or, when it will not run (its job was cancelled), run in its
place. After a batch new vectors go to the memory store and, one batch later (`_save`), to disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .keys import ChunkKeys, chunk_keys

RUN, FOLLOW, DONE = 0, 1, 2  # a chunk runs, waits for an identical chunk's vector, or has its vector


@dataclass(eq=False)
class _Slot:
    """A chunk queued to run that identical chunks wait for: its owner (job, chunk), copies waiting,
    and once run its vector (tensor, row) while copies still wait for it."""

    job: object  # a chunk_queue.Job
    chunk: int
    waiting: int = 0
    vector: tuple | None = None
    serial: int = -1  # set when a copy took over: the batch it runs in


class QueueReuse:
    """Chunk reuse for `ChunkQueue` (see the module docstring); ``job`` and ``batch`` arguments are the
    queue's `Job` and `Batch`, ``plan`` an `EncodingPlan`."""

    def keys_for(self, plan) -> ChunkKeys | None:
        """`chunk_keys` of ``plan`` as this queue keys chunks (None when reuse is off); thread-safe, so
        a producer may compute them ahead and pass them to `submit`."""
        if not self.dedup:
            return None
        return chunk_keys(plan, self.cache.salt if self.cache is not None else b"")

    def flush(self) -> None:
        """Write every vector computed so far (and the recency of cache hits) to the persistent cache."""
        self._save(everything=True)

    def _lookup(self, job, keys: ChunkKeys | None) -> dict:
        """Chunks of ``job`` known already: {chunk: (tensor, row) from memory or (dim,) float32 from disk}."""
        keys = job._keys = keys if keys is not None else self.keys_for(job.plan)
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

    def _resolve(self, job, found: dict) -> None:
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

    def _hand_out_followers(self, job, lo: int, hi: int, base: int, budget: int, batch,
                            first: bool) -> tuple[int, int]:
        """Resolve the copies among chunks [lo, hi) of ``job`` being handed to ``batch``: from their
        original's vector (run already), as a copy of an original in this batch (`_fan_out`), or, when
        the original will not run (cancelled), by running themselves within the budget. The range is cut
        before a copy that does not fit, or whose original is still queued for a later batch (it waits:
        the original's job is earlier in the queue, so the first job of a batch never waits). Returns
        (tokens of the copies run instead, the new hi)."""
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
            elif slot is not None and not slot.job.cancelled and slot.chunk >= slot.job._handed:
                # its original is queued for a later batch (this one ran out of budget inside the
                # original's job, which comes earlier in the queue): wait for it, never run it twice
                return extra, c
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

    def _withdraw_copies(self, batch) -> None:
        """``batch`` will not run (packing it failed): its copies wait for their originals again, or run
        themselves when those are gone (lock held)."""
        if batch is None:
            return
        for job, c, _, _ in batch.fan_out:
            job._state[c] = FOLLOW
            slot = self._slots.get(int(job._keys.keys[c]))
            if slot is not None:
                slot.waiting += 1
        batch.fan_out.clear()

    def _waited(self, key: int, slot: _Slot) -> None:
        """One copy fewer waits for ``slot``; forget it when nobody else will ask."""
        slot.waiting -= 1
        if slot.waiting <= 0 and (slot.vector is not None or slot.job.cancelled):
            self._slots.pop(key, None)

    def _release(self, job) -> None:
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

    def _fan_out(self, batch, vectors: torch.Tensor, lost_rows: set = frozenset()) -> None:
        """After a batch: copies in it get their original's vector; originals with copies still waiting
        keep theirs; new vectors go to the memory store and (later, `_save`) the persistent cache. A row
        in ``lost_rows`` has no vector (it failed): its copies still waiting will run it themselves."""
        for job, c, src, o in batch.fan_out:
            self._ensure_vectors(job, vectors.device)
            job._vectors[c] = src._vectors[o]
            job._left -= 1
        n = len(batch.packed.chunk_ids)
        self.stats.add(computed=n, deduplicated=len(batch.fan_out))
        if not self.dedup or n == 0:
            return
        chunk_ids, part = batch.packed.chunk_ids.tolist(), batch.part.tolist()
        keys, idents, rows = [], [], []  # rows: of `vectors`, in step with keys and idents
        with self._lock:
            for i, (c, j) in enumerate(zip(chunk_ids, part)):
                if i in lost_rows:
                    continue
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
                    rows.append(i)
        if self.cache is not None:  # lost rows (zeros) are left out, so each key keeps its own vector
            self._unsaved.append((keys, idents, vectors[rows] if lost_rows else vectors))

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

    def _ensure_vectors(self, job, device) -> None:
        if job._vectors is None:
            job._vectors = torch.zeros((job.plan.n_chunks, self.encoder.spec.hidden_size), dtype=torch.float32,
                                       device=device)  # full width: truncate_dim applies after aggregating

    def _device(self) -> torch.device:
        return torch.device(getattr(self.encoder, "device", None) or "cpu")

