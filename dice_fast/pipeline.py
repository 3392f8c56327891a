"""The producer pipeline: the next batch selected, packed and staged on the device while the current one runs.

    pipe = BatchPipeline(queue, device)            # a producer thread of its own
    while (batch := pipe.next_batch()) is not None:  # as ChunkQueue.next_batch
        pipe.run(batch, run_batch)                  # as ChunkQueue.run: forward (split on OOM), complete
    pipe.close()

Two batches in flight. While batch k runs, the producer thread selects batch k+1 (the queue's
bookkeeping, under its lock: `ChunkQueue.select_batch`), packs it (numpy: `ChunkQueue.pack_batch`) and
stages it (`Staging`): its int arrays -- input_ids, position_ids (T,) int64 and cu_seqlens (n + 1,)
int32 -- are copied into one persistent host buffer (pinned on CUDA), and ONE non-blocking copy of
that buffer goes to the device, whose views the forward reads (`Staged`). The copy is queued on the
consumer's stream, after batch k's forward, so it can never overwrite what a running forward reads.

The batches are exactly the serial loop's (so are the vectors, bit for bit): a batch selected early
is checked when its turn comes (`ChunkQueue.formed_as_now`: the budget did not change after an
out-of-memory batch, nothing was cancelled, no plan was queued that it would have taken) and
otherwise given back (`ChunkQueue.give_back`) and selected again, as the serial loop would have. A
copy of a chunk that runs in batch k gets its vector when batch k+1 completes (`ChunkReuse` keeps it
pending), as the serial loop gives it when k+1 is formed. Selection never overlaps a completion:
`run` waits for the producer's selection before completing the batch. Errors of the producer
(packing) are raised by `next_batch`, in the order the serial loop would raise them.

On a CPU-only torch nothing is pinned (``Staging.pinned`` is False) and the staged views are the host
buffer itself; the same buffer logic runs (tests/test_pipeline.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .packing import PackedBatch

_ALIGN = 8  # bytes: every view of the staging buffer starts on an 8-byte boundary


@dataclass(frozen=True)
class Staged:
    """A batch's int arrays on the device: views of one staged buffer (see the module docstring)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    nbytes: int
    slot: int


def layout(n_tokens: int, n_offsets: int) -> tuple[int, int, int]:
    """Byte offsets of (position_ids, cu_seqlens) and the total size of a staged batch of ``n_tokens``
    tokens and ``n_offsets`` cu_seqlens entries: [input_ids int64 | position_ids int64 | cu int32]."""
    pos, cu = 8 * n_tokens, 16 * n_tokens
    return pos, cu, -(-(cu + 4 * n_offsets) // _ALIGN) * _ALIGN


def can_pin() -> bool:
    """Whether this torch can allocate pinned host memory (a CUDA build with a device)."""
    try:
        torch.empty(1, pin_memory=True)
        return True
    except Exception:  # CPU-only torch: "Cannot access accelerator device when none is available"
        return False


class _Slot:
    def __init__(self):
        self.host: torch.Tensor | None = None
        self.device: torch.Tensor | None = None
        self.copied = None  # CUDA event after this slot's last host-to-device copy


class Staging:
    """Persistent staging buffers, ``slots`` of them used in turn (a slot is written again two batches
    later: the batch that used it has completed by then). device: where the views live; pin: pin the
    host buffers (default: on CUDA, when this torch can). Buffers grow (doubling) and never shrink."""

    def __init__(self, device, slots: int = 2, pin: bool | None = None, stream=None):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.pinned = bool((cuda if pin is None else pin) and can_pin())
        self.stream = stream if stream is not None or not cuda else torch.cuda.current_stream(self.device)
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self.copies = 0  # host-to-device copies issued (one per staged batch on a device other than the CPU)

    def _on_stream(self):
        """The consumer's stream as the current one (this runs in the producer thread)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def capacity(self, slot: int) -> int:
        """Bytes slot ``slot``'s host buffer holds now."""
        host = self._slots[slot].host
        return 0 if host is None else host.numel()

    def stage(self, packed: PackedBatch) -> Staged:
        """Copy ``packed``'s input_ids, position_ids and cu_seqlens into the next slot (and, off the CPU,
        to the device in one non-blocking copy); returns their views."""
        index = self._next
        self._next = (index + 1) % len(self._slots)
        slot = self._slots[index]
        t, c = len(packed.input_ids), len(packed.cu_seqlens)
        o_pos, o_cu, nbytes = layout(t, c)
        if slot.copied is not None:  # the host buffer is read by its last copy until that is done
            slot.copied.synchronize()
        if slot.host is None or slot.host.numel() < nbytes:
            size = max(nbytes, 2 * self.capacity(index), 4096)
            slot.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            if self.device.type != "cpu":  # the consumer's stream owns the block: its reuse waits for the reads
                with self._on_stream():
                    slot.device = torch.empty(size, dtype=torch.uint8, device=self.device)
        host = slot.host.numpy()
        host[:o_pos].view(np.int64)[:] = packed.input_ids
        host[o_pos:o_cu].view(np.int64)[:] = packed.position_ids
        host[o_cu:o_cu + 4 * c].view(np.int32)[:] = packed.cu_seqlens
        buf = slot.host
        if self.device.type != "cpu":
            buf = slot.device
            with self._on_stream():
                buf[:nbytes].copy_(slot.host[:nbytes], non_blocking=self.pinned)
                if self.device.type == "cuda":
                    slot.copied = torch.cuda.Event()
                    slot.copied.record(self.stream)
            self.copies += 1
        return Staged(buf[:o_pos].view(torch.int64), buf[o_pos:o_cu].view(torch.int64),
                      buf[o_cu:o_cu + 4 * c].view(torch.int32), nbytes, index)


class BatchPipeline:
    """`ChunkQueue.next_batch` and `ChunkQueue.run` with the next batch prepared in a producer thread
    (see the module docstring). queue: the `ChunkQueue`; device: the model's; staging: a `Staging`
    (default: two slots on ``device``). One consumer thread calls `next_batch` and `run`; `close` stops
    the producer (a context manager does it on exit). ``given_back``: early batches selected again."""

    def __init__(self, queue, device, staging: Staging | None = None):
        self.queue = queue
        self.staging = staging if staging is not None else Staging(device)
        self._cond = threading.Condition()
        # the producer's work on the next batch: None (idle, or its result is ready), "asked", "selecting"
        # (the consumer may not complete a batch meanwhile), "packing" (selection done)
        self._phase: str | None = None
        self._result = None  # (batch or None, exception or None) prepared and not yet taken
        self._running = False
        self._closed = False
        self.given_back = 0
        self.early = 0  # batches taken as the producer prepared them
        self._thread = threading.Thread(target=self._produce, name="dice_fast-producer", daemon=True)
        self._thread.start()

    def __enter__(self) -> BatchPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ consumer side
    def next_batch(self):
        """The next `dice_fast.chunk_queue.Batch`, staged (``batch.packed.staged``), or None when nothing waits."""
        with self._cond:
            while self._phase is not None:
                self._cond.wait()
            result, self._result = self._result, None
        if result is not None:
            batch, error = result
            if batch is not None and not self.queue.formed_as_now(batch):
                self.queue.give_back(batch)  # the serial loop would have chosen otherwise: choose now
                self.given_back += 1
            elif error is not None:
                raise error
            elif batch is not None:
                self.early += 1
                self._request()
                return batch
        batch = self.queue.next_batch()  # nothing prepared (or given back): as the serial loop does
        if batch is not None:
            self._stage(batch)
            self._request()
        return batch

    def run(self, batch, run_batch=None):
        """`ChunkQueue.run` of ``batch``; it completes only once the producer's selection is done."""
        self._running = True  # stays set if the batch raises: `close` then gives nothing back
        result = self.queue.run(batch, run_batch, before_complete=self._selected)
        self._running = False
        return result

    def close(self) -> None:
        """Stop the producer; a batch it prepared that was not taken goes back to the queue."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        result, self._result = self._result, None
        if result is not None and result[0] is not None and not self._running:
            self.queue.give_back(result[0])

    # ------------------------------------------------------------------ producer side
    def _request(self) -> None:
        with self._cond:
            self._phase = "asked"
            self._cond.notify_all()

    def _selected(self) -> None:
        with self._cond:
            while self._phase in ("asked", "selecting") and not self._closed:
                self._cond.wait()

    def _stage(self, batch) -> None:
        batch.packed = _with_staged(batch.packed, self.staging.stage(batch.packed))

    def _produce(self) -> None:
        while True:
            with self._cond:
                while self._phase != "asked" and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._phase = "selecting"
            batch = error = None
            try:
                batch = self.queue.select_batch()
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
                error = exc
            with self._cond:
                self._phase = "packing"
                self._cond.notify_all()
            try:
                if batch is not None and error is None:
                    self.queue.pack_batch(batch)
                    self._stage(batch)
            except BaseException as exc:  # noqa: BLE001 - packing errors name their job (ChunkQueue._pack)
                error = exc
            with self._cond:
                self._result, self._phase = (batch, error), None
                self._cond.notify_all()


def _with_staged(packed: PackedBatch, staged: Staged) -> PackedBatch:
    return dataclasses.replace(packed, staged=staged)
