"""Raw chunk vectors of a corpus, encoded by the engine (its in-call dedup and chunk cache).

    raw_enc = raw_twin(encoder, chunk_size=64, normalize_chunks=False, cache="/tmp/dice-eval-cache")
    raw = encode_raw_chunks(raw_enc, texts)
    raw.chunks            # (n_chunks, dim) float32, as pooled (never L2-normalised here)

Everything the evaluation derives (every aggregation, ``normalize_chunks`` on and off, MaxSim, the
hybrid, evidence spans, the diagnostics) is a function of these vectors and the chunk spans, so one
encoding per chunk size serves them all.

Reuse is the core's (docs/reuse.md): identical chunks within one call share one forward
(the synthetic passkey haystack repeats one filler paragraph, so most of its chunks are copies;
prose has almost none), and an encoder built with ``cache=`` reads and writes the persistent chunk
cache (`dice_fast.reuse.persistent`; ``--cache-dir`` of ``dice-fast eval``). `RawChunks` reports what
was run from the encoder's `ChunkStats` during the call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

__all__ = ["RawChunks", "encode_raw_chunks", "encode_timed", "open_cache"]


@dataclass(frozen=True)
class RawChunks:
    """Raw chunk vectors of ``n_docs`` documents at one chunk size, and where each chunk lies.

    chunks: (n_chunks, dim) float32 as pooled; chunk_document: (n_chunks,) int64, non-decreasing;
    chunk_start / chunk_end: (n_chunks,) int64 content token span in the document (no specials);
    chunk_weights: (n_chunks,) float32 wrapped token count (text + special + prefix tokens: the
    ``weighted_mean`` weights); chunk_start_char / chunk_end_char: (n_chunks,) int64 character span
    in the document's text, or None when the engine does not give spans; n_computed: chunks the
    model ran (identical chunks within the call run once); n_cached: chunks served by the chunk
    cache (each occurrence); tokens_run: wrapped tokens the model ran; from_cache: every chunk came
    from the chunk cache (none ran).
    """

    chunks: np.ndarray
    chunk_document: np.ndarray
    chunk_start: np.ndarray
    chunk_end: np.ndarray
    chunk_weights: np.ndarray
    n_docs: int
    chunk_start_char: np.ndarray | None = None
    chunk_end_char: np.ndarray | None = None
    n_computed: int = 0
    n_cached: int = 0
    tokens_run: int = 0
    from_cache: bool = False


def encode_raw_chunks(encoder, texts: list[str], progress=None) -> RawChunks:
    """Raw chunk vectors of ``texts`` (n_docs strings): ``encoder.encode_documents(texts, return_chunks=True)``.

    encoder: a `DiceEncoder` with ``normalize_chunks=False``; its chunk vectors are returned as
    pooled (with ``strategy="single"`` each document is one chunk, its first window); build it with
    ``cache=`` to reuse chunks across calls and runs. progress: called as ``progress(documents,
    tokens)`` with increments (tokens actually run). Not for an encoder used by other threads at
    the same time (the counts are differences of its `ChunkStats`).
    """
    if encoder.normalize_chunks:
        raise ValueError("encode_raw_chunks needs an encoder with normalize_chunks=False (see dice_fast.eval.run.raw_twin)")
    tokens = [0]

    def count(documents: int, tokens_run: int) -> None:
        tokens[0] += tokens_run
        if progress is not None:
            progress(documents, tokens_run)

    before = encoder.chunk_stats.snapshot()
    out = encoder.encode_documents(texts, return_chunks=True, progress=count)
    after = encoder.chunk_stats.snapshot()
    computed, from_disk = (after[k] - before[k] for k in ("computed", "disk_hits"))
    return RawChunks(
        chunks=out.chunks, chunk_document=out.chunk_document.astype(np.int64),
        chunk_start=out.chunk_start.astype(np.int64), chunk_end=out.chunk_end.astype(np.int64),
        chunk_weights=(out.chunk_end - out.chunk_start + encoder.chunk_overhead).astype(np.float32),
        n_docs=len(out.documents), chunk_start_char=out.chunk_start_char, chunk_end_char=out.chunk_end_char,
        n_computed=computed, n_cached=from_disk, tokens_run=tokens[0], from_cache=computed == 0 and from_disk > 0,
    )


def encode_timed(raw_enc, task, desc: str, show_progress: bool):
    """Raw chunk vectors of ``task.corpus`` (`RawChunks`) in one `encode_raw_chunks` call (the engine's
    chunk keys, not the texts, decide what is reused), and its timing ``{"seconds", "tokens"}``."""
    from ..progress import ProgressBar

    bar = ProgressBar(None, desc=desc, show=show_progress and bool(task.corpus))
    t0 = time.perf_counter()
    try:
        raw = encode_raw_chunks(raw_enc, task.corpus, bar)
    finally:
        bar.close()
    return raw, {"seconds": time.perf_counter() - t0, "tokens": bar.tokens}


def open_cache(encoder, cache_dir):
    """The `ChunkCache` the raw encodings use: ``cache_dir`` opened, else the encoder's own, else None."""
    if cache_dir is not None:
        from ..reuse import ChunkCache

        return ChunkCache(cache_dir)
    return None if encoder.cache is None else encoder.cache.cache
