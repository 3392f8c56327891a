"""Segment pooling in vectorised PyTorch: the fast path that needs nothing but torch.

Shapes and semantics are those of `dice_fast.ops.spec` (this module implements the same two ops):

* `pool_chunks_torch`: hidden (total_tokens, H) float32 / bfloat16 / float16, cu_seqlens
  (n_chunks + 1,) int32 -> (n_chunks, H) float32;
* `aggregate_documents_torch`: chunks (n_chunks, H) float32, cu_doc_chunks (n_docs + 1,) int64,
  chunk_weights (n_chunks,) float32 or None -> (n_docs, H) float32.

It is the default on the CPU when the C++ extension is not built (`dice_fast.ops.resolve_impl`),
and runs on any device torch does. No Python loop over chunks or documents, and no host
synchronisation (no ``.item()``, no value-sized allocation), so it can run on CUDA too:

* Token -> chunk: every token row gets its chunk id by a running sum over chunk ends (rows past
  the last chunk go to a scratch row that is dropped), then ``index_add_`` sums the rows in
  float32. On the CPU ``index_add_`` adds the rows of a chunk one by one in row order, so a chunk's
  sum depends only on its own rows: it is bit-identical whichever batch or offset the chunk is
  packed at. bf16 / fp16 rows are widened to float32 a few MiB at a time (the slab stays in cache).
* Chunk -> document: per-chunk scalars (norms, weights, top-k ranks, softmax weights) are
  computed in float64, so ranking ties and softmax weights match the float64 reference; they fold
  into one float32 coefficient per chunk and the document vector is one ``index_add_`` (or a
  ``scatter_reduce_(amax)`` for ``max``; a small one on the CPU is reduced on the calling thread,
  bit-identical: see `SERIAL_ELEMENTS`). Top-k ranks come from two stable sorts (by norm
  descending, then by document): ties go to the earlier chunk. Softmax uses a segment max.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .spec import NORM_EPS, check_aggregate_inputs, check_pool_chunks_inputs

__all__ = ["pool_chunks_torch", "aggregate_documents_torch"]

# bf16 / fp16 hidden states are widened to float32 SLAB_BYTES at a time, so the slab is still in
# cache when index_add_ reads it. Measured on 2 cores of an AMD EPYC (32 MiB L3), bf16 16k x 1024
# tokens: 5.8 ms with 4 MiB slabs vs 45 ms widening the whole batch at once; 8k x 4096: 14 ms vs 90 ms.
SLAB_BYTES = 4 << 20
NORM_BLOCK_BYTES = 1 << 20  # rows of chunk vectors widened to float64 at a time (see _norms_float64)
# Chunk vectors of at most this many elements (a query, a short document: ~85 rows of 384) are summed
# into documents on the calling thread, a segment's rows in the same order as index_add_ (bit-identical):
# mean and max in numpy (`_serial_mean_max`), the weighted ones by `torch.segment_reduce`. index_add_ /
# scatter_reduce_ enter an OpenMP parallel region at any size, and its idle threads then spin for ~3-10
# ms: the OpenVINO forward of the next query, sharing the cores, ran 6.7-7.0 ms instead of 4.2 (12
# tokens, 2-core Zen 2, RESULTS §35). Above it index_add_ is the faster (20,000 rows: 1.6 ms against
# segment_reduce's 9.5) and one forward of such a batch dwarfs the spin.
SERIAL_ELEMENTS = 1 << 15


def _slab_rows(hidden_size: int) -> int:
    return max(64, SLAB_BYTES // (4 * max(1, hidden_size)))


def _segment_ids(cu: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Segment of every row ``0..n_rows-1`` for offsets ``cu`` (n_seg + 1,) int64: rows in no
    segment (after ``cu[-1]``) get ``n_seg``; empty segments own no row.

    Row ``r`` belongs to segment ``#{s : cu[s + 1] <= r}``: a 1 at every segment end, then a running
    sum. (``searchsorted`` gives the same but is a parallel op: 0.03 ms vs 0.15-6 ms for 16k rows on
    2 busy cores of an AMD EPYC, where every parallel region pays for the other processes.)
    """
    ends = torch.zeros(n_rows + 1, dtype=torch.int64, device=cu.device)
    ends.index_add_(0, cu[1:].clamp_max(n_rows), torch.ones_like(cu[1:]))
    return ends[:n_rows].cumsum(0)


def pool_chunks_torch(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """Token states -> one float32 vector per chunk.

    hidden: (total_tokens, hidden_size) float32/bf16/fp16; cu_seqlens: (n_chunks + 1,) int32 on
    hidden's device. Returns (n_chunks, hidden_size) float32. ``pooling``: mean | cls | last.
    An empty chunk (outside the contract) pools to zeros.
    """
    check_pool_chunks_inputs(hidden, cu_seqlens, pooling)
    n, H = cu_seqlens.numel() - 1, hidden.shape[1]
    T = hidden.shape[0]
    if n == 0 or H == 0 or T == 0:
        return torch.zeros((n, H), dtype=torch.float32, device=hidden.device)
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    if pooling == "mean":
        seg = _segment_ids(cu, T)
        acc = torch.zeros((n + 1, H), dtype=torch.float32, device=hidden.device)  # row n: scratch
        if hidden.dtype == torch.float32:
            acc.index_add_(0, seg, hidden)
        else:
            step = _slab_rows(H)
            for r0 in range(0, T, step):
                acc.index_add_(0, seg[r0 : r0 + step], hidden[r0 : r0 + step].float())
        return acc[:n] / lengths.clamp_min(1).unsqueeze(1).to(torch.float32)
    rows = cu[:-1] if pooling == "cls" else cu[1:] - 1
    picked = hidden.index_select(0, rows.clamp(0, T - 1)).to(torch.float32)
    return picked.masked_fill_((lengths == 0).unsqueeze(1), 0.0)


def aggregate_documents_torch(
    chunks: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: Optional[torch.Tensor] = None,
    aggregation: str = "mean",
    top_k: int = 1,
    temperature: float = 1.0,
    normalize_chunks: bool = False,
    normalize: bool = True,
) -> torch.Tensor:
    """Chunk vectors -> one float32 vector per document.

    chunks: (n_chunks, hidden_size) float32; cu_doc_chunks: (n_docs + 1,) int64; chunk_weights:
    (n_chunks,) float32, needed by ``weighted_mean``. Returns (n_docs, hidden_size) float32.
    A document without chunks (outside the contract) gives a zero vector, like the reference.
    """
    check_aggregate_inputs(chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature)
    n, H = chunks.shape
    D = cu_doc_chunks.numel() - 1
    dev = chunks.device
    if D == 0 or n == 0 or H == 0:
        return torch.zeros((D, H), dtype=torch.float32, device=dev)
    cu = cu_doc_chunks
    serial = dev.type == "cpu" and n * H <= SERIAL_ELEMENTS  # the same sums and maxima, on this thread alone
    if serial and aggregation in ("mean", "max") and not chunks.requires_grad:
        return _serial_mean_max(chunks, cu.numpy(), aggregation, normalize_chunks, normalize)
    doc = _segment_ids(cu, n)  # (n,) in [0, D]; D = a chunk after the last document (scratch)
    counts = torch.cat([cu[1:] - cu[:-1], cu.new_ones(1)])  # (D + 1,) chunks per document, 1 for scratch

    norms = None  # (n,) float64 L2 norms of the chunks as pooled: the salience signal (spec)
    if normalize_chunks or aggregation in ("topk_norm", "softmax_norm"):
        norms = _norms_float64(chunks)
    coef = _chunk_coefficients(cu, doc, counts, norms, chunk_weights, aggregation, top_k, temperature)
    if normalize_chunks:
        inv = _inverse_norms(chunks, norms)
        coef = inv if coef is None else coef * inv
    x = _scaled(chunks, coef)

    if serial:  # weighted rows (weighted_mean, top-k, softmax), summed as `_serial_mean_max` sums
        out = torch.segment_reduce(x, "sum", lengths=torch.from_numpy(np.diff(_segment_edges(cu.numpy(), n))))[:D]
    elif aggregation == "max":
        out = torch.full((D + 1, H), float("-inf"), dtype=torch.float32, device=dev)
        out.scatter_reduce_(0, doc.unsqueeze(1).expand(n, H), x, "amax")
        out = out[:D].masked_fill_((counts[:D] == 0).unsqueeze(1), 0.0)
    else:
        out = torch.zeros((D + 1, H), dtype=torch.float32, device=dev)
        out.index_add_(0, doc, x)
        out = out[:D]
    if aggregation == "mean":
        out /= counts[:D].clamp_min(1).unsqueeze(1).to(torch.float32)
    if normalize:
        out /= torch.linalg.vector_norm(out, dim=1, keepdim=True).clamp_min(NORM_EPS)
    return out


def _segment_edges(cu: np.ndarray, n: int) -> np.ndarray:
    """(D + 2,) int64 first row of each of the D documents of offsets ``cu`` (D + 1,) over ``n`` rows, of
    the rows after the last (scratch), and ``n``: the segments the general path's segment ids make."""
    return np.concatenate([[0], np.minimum(cu[1:], n), [n]])


def _inverse_norms(chunks: torch.Tensor, norms: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) float64 1 / max(norm, NORM_EPS) of each chunk (``norms``: their `_norms_float64`, if known)."""
    return 1.0 / (_norms_float64(chunks) if norms is None else norms).clamp_min(NORM_EPS)


def _scaled(chunks: torch.Tensor, coef: torch.Tensor | None) -> torch.Tensor:
    """The chunks' rows, each times its float64 ``coef`` rounded to float32 (None: as they are)."""
    return chunks if coef is None else chunks * coef.to(torch.float32).unsqueeze(1)


def _serial_mean_max(chunks: torch.Tensor, cu: np.ndarray, aggregation: str, normalize_chunks: bool,
                     normalize: bool) -> torch.Tensor:
    """`aggregate_documents_torch`'s mean or max of a small CPU input (`SERIAL_ELEMENTS`) on the calling
    thread, bit for bit the ``index_add_`` / ``scatter_reduce_`` path: the same float32 products, sums
    row by row in chunk order from zero (the k-th chunks of all documents in one step), divisions, and
    torch's own norms. In numpy but for the norms:
    each torch op cost 10-60 µs just after a forward had left the caches cold, and the ~25 of the
    general path took 0.5 ms of one query's 7 ms call on OpenVINO (2-core Zen 2, RESULTS §36)."""
    D = len(cu) - 1
    x = chunks.numpy()
    if normalize_chunks:
        x = x * _inverse_norms(chunks).numpy().astype(np.float32)[:, None]
    counts = np.diff(cu)
    edges = _segment_edges(cu, len(x))
    starts, rows = edges[:D], np.diff(edges[:D + 1])  # each document's rows
    out = np.zeros((D, x.shape[1]), np.float32)
    for k in range(int(rows.max(initial=0))):  # the k-th chunk of every document that has one, at once
        docs = np.flatnonzero(rows > k)
        if aggregation == "max":
            out[docs] = x[starts[docs]] if k == 0 else np.maximum(out[docs], x[starts[docs] + k])
        else:
            out[docs] += x[starts[docs] + k]
    if aggregation == "mean":
        out /= np.maximum(counts, 1).astype(np.float32)[:, None]
    if normalize:
        out /= np.maximum(torch.linalg.vector_norm(torch.from_numpy(out), dim=1, keepdim=True).numpy(),
                          np.float32(NORM_EPS))
    return torch.from_numpy(out)


def _norms_float64(x: torch.Tensor) -> torch.Tensor:
    """(n,) float64 L2 norms of the rows of ``x`` (n, H), a cache-sized block of rows at a time.

    float64 so that top-k ranks (ties included) and softmax weights are those of the reference:
    a float32 norm's last-bit error, divided by a small temperature, moves softmax weights by
    ~1e-5. In blocks because widening the whole matrix allocates and faults in a fresh float64
    buffer each call: 2000 x 4096 chunks 119 ms at once vs 10 ms in 1 MiB blocks (AMD EPYC, 1 thread).
    """
    n, H = x.shape
    step = n if x.device.type != "cpu" else max(1, NORM_BLOCK_BYTES // (8 * max(1, H)))
    if n <= step:  # one block: the same call without the buffer (a query's chunk: 6 µs, not 18)
        return torch.linalg.vector_norm(x, dim=1, dtype=torch.float64)
    out = torch.empty(n, dtype=torch.float64, device=x.device)
    for r0 in range(0, n, step):
        torch.linalg.vector_norm(x[r0 : r0 + step], dim=1, dtype=torch.float64, out=out[r0 : r0 + step])
    return out


def _chunk_coefficients(cu, doc, counts, norms, chunk_weights, aggregation, top_k, temperature):
    """(n,) float64 weight of each chunk in its document's weighted sum (None for mean and max,
    which need none: mean divides the sum by the chunk count afterwards)."""
    D = cu.numel() - 1
    if aggregation == "weighted_mean":
        w = chunk_weights.to(torch.float64)
        total = torch.zeros(D + 1, dtype=torch.float64, device=w.device).index_add_(0, doc, w)
        return w / total.clamp_min(NORM_EPS)[doc]
    if aggregation == "topk_norm":
        n = doc.numel()
        # order chunks by (document, norm descending, index): stable sorts keep equal norms in index
        # order, so ties go to the earlier chunk
        order = torch.sort(norms, descending=True, stable=True).indices
        order = order[torch.sort(doc[order], stable=True).indices]
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n, device=order.device) - cu[doc[order]]  # position inside the document
        kept = counts.clamp_max(int(top_k)).to(torch.float64)  # min(k, m) chunks averaged
        return (rank < int(top_k)).to(torch.float64) / kept[doc]
    if aggregation == "softmax_norm":
        z = norms / float(temperature)
        top = torch.full((D + 1,), float("-inf"), dtype=torch.float64, device=z.device)
        top.scatter_reduce_(0, doc, z, "amax")
        e = torch.exp(z - top[doc])
        total = torch.zeros(D + 1, dtype=torch.float64, device=z.device).index_add_(0, doc, e)
        return e / total[doc]
    return None
