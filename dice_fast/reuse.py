"""What identifies a chunk, and the in-memory side of reusing chunk vectors.

A chunk's pooled vector is a pure function of the model, the options that shape a chunk (dtype,
device type, token pooling, causal or bidirectional attention) and the token ids the model sees
(special tokens, prefix, text, suffix), plus its start offset under ``positions="global"``. So:

* `chunk_keys(plan, salt)` gives every chunk of a plan its **identity** (bytes: a positions header
  and the wrapped ids as int32) and a 64-bit **key** (the first 8 bytes of SHA-256 of salt +
  identity). Keys only find candidates: a match is used only when the identities are equal.
* `MemoryCache`: a least-recently-used map key -> (identity, vector row), bounded in bytes.
* `ChunkStats`: counters of chunks computed, deduplicated, and served from memory or disk.

The persistent store is `dice_fast.chunk_cache`; the queue's use of all three is
`dice_fast.scheduler_reuse`.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


# --------------------------------------------------------------------------------------------
@dataclass
class ChunkKeys:
    """keys: (n_chunks,) int64; messages: n_chunks bytes, ``salt`` + identity (see the module docstring)."""

    keys: np.ndarray
    messages: list
    salt_len: int

    def identity(self, c: int) -> bytes:
        """The identity of chunk ``c`` (what is stored and compared)."""
        return self.messages[c][self.salt_len:]


def chunk_keys(plan, salt: bytes = b"") -> ChunkKeys:
    """Identity and key of every chunk of ``plan`` (an `EncodingPlan`). Cost: one pass over its
    tokens plus about a microsecond per chunk (a SHA-256 of its ids)."""
    ids = plan.tokens.ids
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= 2**31):
        raise ValueError("token ids must lie in [0, 2**31) to be keyed")
    raw = ids.astype("<i4").tobytes()
    pre = np.asarray(plan.prefix, "<i4").tobytes()
    suf = np.asarray(plan.suffix, "<i4").tobytes()
    ch = plan.chunks
    starts = (plan.tokens.offsets[ch.document] + ch.start) * 4
    ends = starts + ch.length * 4
    messages = []
    sha = hashlib.sha256
    if plan.global_positions:
        for s, e, off in zip(starts.tolist(), ends.tolist(), ch.start.tolist()):
            messages.append(salt + b"G" + off.to_bytes(8, "little") + pre + raw[s:e] + suf)
    else:
        head = salt + b"L" + pre
        messages = [head + raw[s:e] + suf for s, e in zip(starts.tolist(), ends.tolist())]
    keys = np.fromiter((int.from_bytes(sha(m).digest()[:8], "little", signed=True) for m in messages),
                       np.int64, len(messages))
    return ChunkKeys(keys, messages, len(salt))


# --------------------------------------------------------------------------------------------
@dataclass
class ChunkStats:
    """Counters of chunk reuse (all cumulative; thread-safe `add`).

    computed: chunks the model ran. deduplicated: chunks that shared the forward of an identical chunk
    queued at the same time. memory_hits / memory_misses: the in-memory store; disk_hits / disk_misses:
    the persistent cache (looked up only after the memory store missed); damaged: cache rows found
    damaged (dropped, recomputed); written: rows written to the persistent cache."""

    computed: int = 0
    deduplicated: int = 0
    memory_hits: int = 0
    memory_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    damaged: int = 0
    written: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + int(v))

    def snapshot(self) -> dict:
        with self._lock:
            return {k: getattr(self, k) for k in ("computed", "deduplicated", "memory_hits", "memory_misses",
                                                   "disk_hits", "disk_misses", "damaged", "written")}


class MemoryCache:
    """Least-recently-used chunk vectors in memory, at most ``max_bytes`` (vector + identity bytes).

    Values are rows of the batch output tensors (on the model's device): nothing is copied to store
    them, and a batch's tensor is freed when its last row is evicted. Thread-safe."""

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: int, message: bytes):
        """(tensor, row) stored for ``key`` with this exact ``message``, else None."""
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0] != message:
                return None
            self._items.move_to_end(key)
            return item[1], item[2]

    def put(self, key: int, message: bytes, tensor, row: int) -> None:
        size = len(message) + tensor.shape[1] * tensor.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[3]
            self._items[key] = (message, tensor, row, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, item = self._items.popitem(last=False)
                self.bytes -= item[3]


__all__ = ["ChunkKeys", "ChunkStats", "MemoryCache", "chunk_keys"]
