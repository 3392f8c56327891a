"""Chunk reuse: a chunk's vector depends only on its wrapped ids, so it is computed once.

    keys.py        what identifies a chunk (identity bytes, 64-bit key)
    memory.py      the in-memory store (least recently used, bounded) and the reuse counters
    persistent.py  the persistent SQLite store shared by processes (`ChunkCache`)
    cache_files.py its files: private (0700 / 0600), checked read-only before anything writes to them
    manager.py     what the queue holds: look up, register, hand out, fan out, save, release

"""

from __future__ import annotations

from .keys import ChunkKeys, chunk_keys
from .memory import ChunkStats, MemoryCache
from .persistent import CacheError, CacheNamespace, ChunkCache, open_cache

__all__ = ["CacheError", "CacheNamespace", "ChunkCache", "ChunkKeys", "ChunkStats", "MemoryCache", "chunk_keys",
           "open_cache"]
