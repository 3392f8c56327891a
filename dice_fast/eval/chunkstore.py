"""Raw chunk vectors of a corpus: each distinct chunk encoded once, optionally kept on disk.

    raw = encode_raw_chunks(raw_enc, texts, cache_dir="/tmp/dice-eval-cache")
    raw.chunks            # (n_chunks, dim) float32, as pooled (never L2-normalised here)

Everything the evaluation derives (every aggregation, ``normalize_chunks`` on and off, MaxSim, the
hybrid, evidence spans, the diagnostics) is a function of these vectors and the plan, so one
encoding per chunk size serves them all.

* **Distinct chunks once.** A chunk vector is a pure function of the chunk's wrapped token ids
  (local positions, block-diagonal attention: DESIGN.md §2), so chunks with equal ids are run once
  and the vector is copied. The synthetic passkey haystack repeats one filler paragraph, so most of
  its chunks are copies (about 1 in 40 is distinct at 32k tokens); prose (needle) has almost none.
* **Disk cache** (``cache_dir``): one ``.npz`` per call, keyed by a SHA-256 of the model, every option
  that shapes a chunk vector (chunk size, overlap, positions, pooling, prefixes, attention, window,
  dtype, device type) and the texts. Options that act after pooling (aggregation, top_k,
  temperature, normalize_chunks, normalize) are not in the key: they are applied later. A file whose
  shape does not match the plan is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass

import numpy as np

__all__ = ["RawChunks", "encode_raw_chunks", "cache_key"]

# options applied after a chunk is pooled, or that do not change any value (batching, kernels)
_NOT_SHAPING = ("aggregation", "top_k", "temperature", "normalize_chunks", "normalize", "max_batch_tokens",
                "pooling_impl", "attention_backend", "device", "dtype")


@dataclass(frozen=True)
class RawChunks:
    """Raw chunk vectors of ``n_docs`` documents at one chunk size, and where each chunk lies.

    chunks: (n_chunks, dim) float32 as pooled; chunk_document: (n_chunks,) int64, non-decreasing;
    chunk_start / chunk_end: (n_chunks,) int64 content token span in the document (no specials);
    chunk_weights: (n_chunks,) float32 wrapped token count (text + special + prefix tokens: the
    ``weighted_mean`` weights); chunk_start_char / chunk_end_char: (n_chunks,) int64 character span
    in the document's text, or None when the engine does not give spans; n_distinct: chunks that
    were (or, read from the cache, had been) run through the model.
    """

    chunks: np.ndarray
    chunk_document: np.ndarray
    chunk_start: np.ndarray
    chunk_end: np.ndarray
    chunk_weights: np.ndarray
    n_docs: int
    chunk_start_char: np.ndarray | None = None
    chunk_end_char: np.ndarray | None = None
    n_distinct: int = 0
    tokens_run: int = 0
    from_cache: bool = False

    @staticmethod
    def concat(parts: list[RawChunks]) -> RawChunks:
        """Documents of ``parts`` back to back (chunk_document shifted by the documents before)."""
        if len(parts) == 1:
            return parts[0]
        shift = np.cumsum([0] + [p.n_docs for p in parts[:-1]])
        spans = all(p.chunk_start_char is not None for p in parts)
        cat = np.concatenate
        return RawChunks(
            chunks=cat([p.chunks for p in parts]), chunk_document=cat([p.chunk_document + s for p, s in zip(parts, shift)]),
            chunk_start=cat([p.chunk_start for p in parts]), chunk_end=cat([p.chunk_end for p in parts]),
            chunk_weights=cat([p.chunk_weights for p in parts]), n_docs=int(sum(p.n_docs for p in parts)),
            chunk_start_char=cat([p.chunk_start_char for p in parts]) if spans else None,
            chunk_end_char=cat([p.chunk_end_char for p in parts]) if spans else None,
            n_distinct=sum(p.n_distinct for p in parts), tokens_run=sum(p.tokens_run for p in parts),
            from_cache=all(p.from_cache for p in parts),
        )


def cache_key(encoder, texts: list[str]) -> str:
    """Hex SHA-256 of the model, the chunk-shaping options of ``encoder`` and ``texts``."""
    import dataclasses

    cfg = {k: v for k, v in dataclasses.asdict(encoder.config).items() if k not in _NOT_SHAPING}
    h = hashlib.sha256()
    for part in (repr(encoder.spec), repr(sorted(cfg.items())), str(encoder.dtype), encoder.device.type, encoder.pooling,
                 str(encoder.window)):
        h.update(part.encode())
        h.update(b"\0")
    h.update(str(len(texts)).encode())
    for t in texts:
        h.update(b"\0")
        h.update(t.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def encode_raw_chunks(encoder, texts: list[str], cache_dir=None, progress=None) -> RawChunks:
    """Raw chunk vectors of ``texts`` (n_docs strings) by ``encoder``, each distinct chunk run once.

    encoder: a `DiceEncoder` with ``normalize_chunks=False``; its chunk vectors are returned as
    pooled (the aggregation is not applied here; with ``strategy="single"`` each document is one
    chunk, its first window). cache_dir: a folder to read
    and write ``<key>.npz`` (see `cache_key`); None: no cache. progress: called as
    ``progress(documents, tokens)`` with increments (tokens actually run).
    """
    from ..scheduler import ChunkQueue

    if encoder.normalize_chunks:
        raise ValueError("encode_raw_chunks needs an encoder with normalize_chunks=False (see dice_fast.eval.run.raw_twin)")
    plan = encoder.plan(texts)
    ch = plan.chunks
    n = ch.n_chunks
    if plan.global_positions:  # a chunk's vector then depends on its offset: no two chunks are copies
        first, inverse = np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    else:
        first, inverse = _distinct_chunks(plan)
    spans = getattr(plan, "chunk_char_spans", None)
    base = dict(chunk_document=ch.document.astype(np.int64), chunk_start=ch.start.astype(np.int64),
                chunk_end=(ch.start + ch.length).astype(np.int64), chunk_weights=plan.chunk_weights,
                n_docs=plan.n_docs, chunk_start_char=None if spans is None else spans[0],
                chunk_end_char=None if spans is None else spans[1], n_distinct=len(first))

    path = None
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        path = os.path.join(cache_dir, cache_key(encoder, texts) + ".npz")
        if os.path.exists(path):
            try:
                with np.load(path) as z:
                    distinct, inv = z["distinct"], z["inverse"]
                if inv.shape == (n,) and np.array_equal(inv, inverse) and distinct.shape == (len(first), encoder.dim):
                    if progress is not None:
                        progress(plan.n_docs, 0)
                    return RawChunks(chunks=distinct[inverse], from_cache=True, **base)
            except (OSError, ValueError, KeyError):
                pass  # damaged or foreign: recompute and overwrite

    distinct = _run_distinct(encoder, plan, first, ChunkQueue, progress)
    if path is not None:
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp.npz")
        os.close(fd)
        np.savez(tmp, distinct=distinct, inverse=inverse)
        os.replace(tmp, path)
    tokens_run = int(plan.chunk_lengths[first].sum()) if n else 0
    return RawChunks(chunks=distinct[inverse], tokens_run=tokens_run, **base)


def _distinct_chunks(plan) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse): the first chunk of each distinct content (ids), (n_distinct,) int64, and the
    distinct index of every chunk, (n_chunks,) int64."""
    ch = plan.chunks
    starts = plan.tokens.offsets[ch.document] + ch.start
    ids = plan.tokens.ids
    index: dict[bytes, int] = {}
    inverse = np.empty(ch.n_chunks, np.int64)
    first = []
    for c in range(ch.n_chunks):
        u = index.setdefault(ids[starts[c] : starts[c] + ch.length[c]].tobytes(), len(index))
        if u == len(first):
            first.append(c)
        inverse[c] = u
    return np.asarray(first, np.int64), inverse


def _run_distinct(encoder, plan, first: np.ndarray, queue_cls, progress) -> np.ndarray:
    """(len(first), dim) float32 vectors of chunks ``first`` of ``plan``, as pooled, through one queue."""
    from ..chunking import ChunkPlan, EncodingPlan, TokenizedDocuments

    ch = plan.chunks
    u = len(first)
    if u == 0:
        return np.zeros((0, encoder.dim), np.float32)
    if plan.global_positions:  # every chunk is its own (first is all chunks)
        out = _run_plan(encoder, plan, queue_cls, progress)
    else:  # one single-chunk "document" per distinct chunk, wrapped like the originals
        lengths = ch.length[first].astype(np.int64)
        starts = plan.tokens.offsets[ch.document[first]] + ch.start[first]
        offsets = np.zeros(u + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        one_each = np.arange(u + 1, dtype=np.int64)
        sub = EncodingPlan(TokenizedDocuments(plan.tokens.ids[gather], offsets),
                           ChunkPlan(one_each[:-1], np.zeros(u, np.int64), lengths, one_each),
                           plan.prefix, plan.suffix)
        out = _run_plan(encoder, sub, queue_cls, progress)
    if progress is not None:
        progress(plan.n_docs, 0)
    return out


def _run_plan(encoder, plan, queue_cls, progress) -> np.ndarray:
    """(plan.n_chunks, dim) float32 pooled chunk vectors of ``plan``, through one queue."""
    queue = queue_cls(encoder)
    job = queue.submit(plan, "mean", keep_chunks=True)
    while not job.done:
        batch = queue.next_batch()
        if batch is None:  # pragma: no cover - a scheduler bug, never silent
            raise RuntimeError("dice_fast.eval: queued chunks were never handed out")
        queue.complete(batch, encoder.run_batch(batch.packed))
        if progress is not None:
            progress(0, batch.packed.n_tokens)
    return np.asarray(job.chunks, np.float32)
