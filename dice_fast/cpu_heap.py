"""The glibc heap under CPU forwards: keep activation pages between operations, hand them back
between windows.

A CPU forward allocates and frees activations of megabytes per operation (MiniLM, 4096 tokens:
6 MB per projection, 25 MB per feed-forward input). Under glibc's default, adaptive thresholds the
freed top of the heap is often returned to the OS and faulted back in, zero-filled, by the next
operation; how often depends on the heap's layout. On batches run back to back (the benchmark's
loop, a steadily loaded server) that costs page faults and system time in ``addmm``'s bias copy and
``gelu``; raising the mmap threshold to glibc's ceiling (32 MiB on 64-bit) and the trim threshold to
1 GiB keeps those pages (measured: benchmarks/RESULTS.md §0.7). Where the heap is trimmed anyway
(after each window of ``encode_documents`` / ``stream_documents``) the pages are faulted in once per
window under either policy and the gain is nil. Page faults cost the same on any x86 CPU, so this is
a rule, not a per-machine measurement. Under steady load the pages of the largest batch stay
resident (the server's worker trims after a quiet second, and at most every 10 s while busy: glibc
keeps freed pages per thread arena, and a loaded server's request threads otherwise grew it;
benchmarks/RESULTS.md §0.11).

    keep_freed_pages()       # once per process, at the first CPU encoder; True if applied
    release_freed_memory()   # after each window of a CPU stream: the kept pages go back to the OS

Both are process-wide (glibc has one heap policy per process); a program that must keep glibc's
defaults sets ``DICE_FAST_CPU_HEAP=default`` before it builds an encoder. Allocations above 32 MiB
(larger models or budgets) are still mapped per allocation. Not glibc (musl, macOS): nothing happens.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from .errors import OptionError

ENV = "DICE_FAST_CPU_HEAP"
MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>

# A window of fewer tokens is not followed by a trim: it leaves at most one small forward's pages
# (MiniLM, 2,048 tokens: 12.6 MB in its largest buffer, the feed-forward's; a larger model's buffers of
# that many tokens pass the mmap threshold and go back as they are freed), and the next window reuses
# them. A trim costs ~0.15 ms, 2 % of one query's call on OpenVINO (2-core Zen 2, RESULTS §36).
SMALL_WINDOW_TOKENS = 2048

_LOCK = threading.Lock()
_applied: bool | None = None


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (both must exist: glibc)
        return libc
    except (OSError, AttributeError):  # not glibc
        return None


def keep_freed_pages() -> bool:
    """Set glibc's mmap and trim thresholds so freed activation pages are reused, not re-faulted;
    once per process. Returns whether the policy is in force (False: not glibc, or
    ``DICE_FAST_CPU_HEAP=default``)."""
    global _applied
    with _LOCK:
        if _applied is None:
            mode = os.environ.get(ENV, "keep").strip().lower() or "keep"
            if mode not in ("keep", "default"):
                raise OptionError(f"{ENV}={os.environ[ENV]!r}: expected 'keep' (the default) or 'default'")
            libc = _libc()
            _applied = (mode == "keep" and libc is not None
                        and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                        and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
        return _applied


def release_freed_memory(tokens: int | None = None) -> None:
    """Hand freed heap pages back to the OS (the kept activation pages, and token buffers of varying
    sizes). Called after each window of a CPU stream: the resident size after every window then stays
    at 564-568 MB over 24 windows (MiniLM, 2-core EPYC). ``tokens``: the tokens the window ran; under
    `SMALL_WINDOW_TOKENS` nothing is handed back (None: always)."""
    libc = _libc()
    if libc is not None and (tokens is None or tokens >= SMALL_WINDOW_TOKENS):
        libc.malloc_trim(0)
