"""Out-of-memory faults of a forward kept small: split-and-retry down to one chunk, and a batch budget
that backs off and recovers.

    vectors, failed = run_split(encoder.run_batch, packed, dim)   # (n_chunks, dim); {row: error}
    backoff = BudgetBackoff(4096); backoff.failed(); backoff.budget   # 2048

`run_split` runs a `PackedBatch`; when the forward raises an out-of-memory error (`is_out_of_memory`:
``torch.OutOfMemoryError``, Python's ``MemoryError``, or a RuntimeError of the CPU allocator) it splits
the batch in halves by chunks (along ``cu_seqlens``: a chunk is never cut) and runs each half, down to
one chunk. A chunk's vector does not depend on what else is in its batch (attention is block-diagonal,
pooling per chunk; only the GEMMs' float rounding, ~1e-7 in float32, may move with the batch's
shape), so every chunk that runs in some half gets the vector it would have got in the whole batch;
only a chunk that runs out of memory alone fails. Any other error is raised as is.

`BudgetBackoff` is the rule for the batch budget after an out-of-memory batch: halve it (down to 1
token, which packs one chunk per batch), and double it back after every `RECOVER_AFTER` consecutive
batches without one, up to the configured budget. On CUDA the allocator's cached blocks are released
(``torch.cuda.empty_cache()``) before the halves are retried.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .errors import InputOutOfMemory, is_out_of_memory  # noqa: F401 - part of this module's API
from .packing import PackedBatch

RECOVER_AFTER = 8  # clean batches after which a halved budget doubles again

log = logging.getLogger("dice_fast")


def rows_of(packed: PackedBatch, lo: int, hi: int) -> PackedBatch:
    """The sub-batch of ``packed``'s chunks ``lo:hi`` (in packing order, so still sorted by length)."""
    cu = packed.cu_seqlens
    t_lo, t_hi = int(cu[lo]), int(cu[hi])
    lengths = packed.lengths[lo:hi]
    c_lo, c_hi = packed.chunk_rows(lo, hi)
    pooled = {}
    if packed.pool_rows is not None:  # late chunking: the segments inside these sequences
        pcu = packed.pool_cu
        pooled = dict(pool_rows=packed.pool_rows[int(pcu[c_lo]):int(pcu[c_hi])] - t_lo,
                      pool_cu=(pcu[c_lo:c_hi + 1] - pcu[c_lo]).astype(np.int32), pool_seq=packed.pool_seq[c_lo:c_hi] - lo)
    return PackedBatch(input_ids=packed.input_ids[t_lo:t_hi], position_ids=packed.position_ids[t_lo:t_hi],
                       cu_seqlens=(cu[lo:hi + 1] - cu[lo]).astype(np.int32),
                       max_seqlen=int(lengths.max()) if len(lengths) else 0,
                       chunk_ids=packed.chunk_ids[c_lo:c_hi], lengths=lengths, **pooled)


def run_split(run_batch, packed: PackedBatch, dim: int, on_oom=None) -> tuple[torch.Tensor, dict[int, str]]:
    """Run ``packed`` with ``run_batch`` (PackedBatch -> (n, dim) float32), splitting on out-of-memory.

    Returns the vectors (n_chunks, dim) float32 in packing order (rows of failed chunks are zero) and
    ``{row: the allocator's message}`` for each chunk that ran out of memory alone (late chunking: each
    chunk of a window that ran out of memory alone). ``on_oom()`` is
    called after every out-of-memory forward (e.g. to free cached memory before the retry). Errors
    other than out-of-memory propagate.
    """
    done: list[tuple[int, torch.Tensor]] = []
    failed: dict[int, str] = {}
    todo = [(0, len(packed.lengths))]
    while todo:
        lo, hi = todo.pop()
        error = None
        try:
            done.append((lo, run_batch(packed if (lo, hi) == (0, len(packed.lengths)) else rows_of(packed, lo, hi))))
        except Exception as exc:  # noqa: BLE001 - only allocator failures are retried
            if not is_out_of_memory(exc):
                raise
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else 'no message'}"
        if error is None:
            continue
        if on_oom is not None:  # outside the except block: the failed forward's frames are released
            on_oom()
        if hi - lo == 1:
            failed.update(dict.fromkeys(range(*packed.chunk_rows(lo, hi)), error))
            log.warning("dice_fast: a chunk of %d tokens ran out of memory alone in its batch", int(packed.lengths[lo]))
        else:
            mid = (lo + hi) // 2
            todo += [(mid, hi), (lo, mid)]  # the first half runs first
    device = done[0][1].device if done else torch.device("cpu")
    out = torch.zeros((packed.n_chunks, dim), dtype=torch.float32, device=device)
    for lo, vectors in done:
        first = packed.chunk_rows(lo, lo)[0]
        out[first:first + len(vectors)] = vectors
    return out, failed


class BudgetBackoff:
    """The batch budget after out-of-memory batches (see the module docstring). Not thread-safe: one
    consumer runs the batches."""

    def __init__(self, configured: int):
        self.configured = self.budget = int(configured)
        self._clean = 0

    def failed(self) -> None:
        """A batch ran out of memory: halve the budget (at least 1 token) and restart the clean count."""
        self.budget = max(1, self.budget // 2)
        self._clean = 0
        log.warning("dice_fast: out of memory; the batch budget backs off to %d tokens", self.budget)

    def succeeded(self) -> None:
        """A batch ran without running out of memory; after `RECOVER_AFTER` such, double the budget."""
        if self.budget >= self.configured:
            return
        self._clean += 1
        if self._clean >= RECOVER_AFTER:
            self.budget, self._clean = min(self.configured, self.budget * 2), 0


def release_cached_memory(device: torch.device) -> None:
    """Hand the CUDA caching allocator's free blocks back before a retry (nothing to do on a CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
