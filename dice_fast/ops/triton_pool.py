"""Triton segment pooling: token states -> chunk vectors -> document vectors.

Shapes (see `dice_fast.ops.spec` for the full semantics, which this module implements):

* `pool_chunks_triton`: hidden (total_tokens, H) float32 / bfloat16 / float16, cu_seqlens
  (n_chunks + 1,) int32 -> (n_chunks, H) float32; pooling ``mean`` | ``cls`` | ``last``.
* `aggregate_documents_triton`: chunks (n_chunks, H) float32, cu_doc_chunks (n_docs + 1,) int64,
  chunk_weights (n_chunks,) float32 or None -> (n_docs, H) float32; aggregation ``mean`` |
  ``weighted_mean`` | ``max`` | ``topk_norm`` | ``softmax_norm``.

Everything accumulates in float32, and no launcher synchronises with the device: the grids are
sized from host-known shapes only (``hidden.shape``, ``cu_seqlens.numel()``), never from the
values of the offsets.

Three layers, as in the rest of ``dice_fast.ops``:

1. ``@triton.jit`` kernels (``_segment_reduce_kernel`` and friends, below);
2. host launchers ``_pool_chunks_launch`` / ``_aggregate_launch``: validate with the shared
   checks of `spec`, allocate, and take every launch parameter from `_launch_config`;
3. ops registered with ``torch.library.custom_op`` as ``dice_fast::pool_chunks_triton`` and
   ``dice_fast::aggregate_documents_triton``, declared from the schema strings of `spec.SCHEMAS`
   (with fake implementations, so ``torch.compile`` traces them), behind the documented functions
   `pool_chunks_triton` and `aggregate_documents_triton`.

Kernel design (one generic *segmented row reduction* serves both steps: chunks are segments of
token rows, documents are segments of chunk rows):

* Grid ``(n_segments + cdiv(n_rows, PIECE), cdiv(H, BLOCK_H))``. Axis 1 splits the hidden size into
  column blocks (each row block of a program is ``BLOCK_H`` contiguous elements: wide, coalesced,
  16-byte vector loads). Axis 0 splits every segment into *pieces* of at most ``PIECE`` rows, placed
  relative to the segment's start: program ``s < n_segments`` (the *head*) reduces rows
  ``[start_s, start_s + PIECE)`` of segment ``s``; program ``n_segments + j`` (a *tile* program)
  reduces the piece of the segment that contains row ``j * PIECE`` which starts in
  ``[j * PIECE, (j + 1) * PIECE)`` (found by a binary search over the offsets; at most one such
  piece exists, so tile programs without one exit at once). The grid therefore covers every piece
  of every segment whatever the lengths are, and no program reads more than ``PIECE`` rows: an
  8192-token chunk is reduced by 32 programs per column block while 1-token chunks cost one
  program each (load balance without a device-side plan or a host sync).
* A segment that fits in one piece is finished by its head program. Longer ones leave their head
  partial in ``out`` and the other pieces in a float32 workspace row (one per tile program);
  ``_segment_finalize_kernel`` adds them in piece order. Partials are never combined with atomics,
  so results are deterministic, and because pieces are placed relative to the segment start a chunk
  gives bit-identical vectors whichever batch or offset it is packed at.
* Inside a program rows are streamed in tiles of ``BLOCK_R`` rows into a 2-D float32 accumulator
  ``[BLOCK_R, BLOCK_H]`` that is summed across rows once at the end (no cross-warp reduction per
  tile); every hidden state is read exactly once.
* Documents: ``_row_norm_kernel`` computes chunk L2 norms (only when an aggregation or
  ``normalize_chunks`` needs them); ``_doc_coef_kernel`` turns norms / weights into one float32
  coefficient per chunk (``1/m``, ``w / sum w``, top-k indicator ``/ min(k, m)``, softmax weight,
  each times ``1 / max(norm, eps)`` when ``normalize_chunks``); the same segmented reduction then
  computes ``sum_i coef_i * x_i`` (or ``max_i coef_i * x_i``) and, when ``normalize``, writes each
  column block's sum of squares so ``_normalize_rows_kernel`` can divide by the row norm.
  ``topk_norm`` / ``softmax_norm`` use the norms of the chunks as pooled, also under
  ``normalize_chunks`` (the spec). Top-k ranks are computed in-kernel,
  ``rank_i = #{j : n_j > n_i or (n_j == n_i and j < i)}`` within the document (ties go to the
  earlier chunk), ``O(128 * m)`` comparisons per program of 128 chunks: no sort, no host sync.

Block sizes are chosen in `_launch_config` only; the numbers there are reasoned, not yet tuned on
the H200 (no device was available when this was written): measure with the benchmark harness and
record the figures next to the constants. What was checked without a device, by compiling every
kernel variant for sm_90 with the ptxas bundled with triton 3.9: no local memory / stack in any
variant; the pooling reduction (bf16, BLOCK_H 512, BLOCK_R 16, 8 warps) uses 71 registers and
16-byte ``ld.global.v4`` loads (4 per thread per row tile) when H is a multiple of 16 elements
and the base pointer 16-byte aligned, which Triton specialises on at run time; otherwise the
loads fall back to scalar ones (correct, slower: e.g. H = 100).
"""

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .spec import (
    AGGREGATIONS,
    NORM_EPS,
    SCHEMAS,
    check_aggregate_inputs,
    check_pool_chunks_inputs,
)

try:  # triton is optional: importing this module must work (and `available()` answer) without it
    import triton
    import triton.language as tl

    _jit = triton.jit
    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except Exception as _e:  # pragma: no cover - exercised only on machines without triton
    triton = None
    _TRITON_IMPORT_ERROR = _e

    class tl:  # noqa: N801 - placeholder so the kernel signatures below still evaluate
        constexpr = None

    def _jit(fn):
        return fn


__all__ = ["available", "pool_chunks_triton", "aggregate_documents_triton"]

# codes shared with the kernels' constexpr switches
_CLS, _LAST = 1, 2  # POOLINGS.index("cls"), POOLINGS.index("last")
_AGG_MEAN, _AGG_WMEAN, _AGG_MAX, _AGG_TOPK, _AGG_SOFTMAX = range(5)
assert AGGREGATIONS == ("mean", "weighted_mean", "max", "topk_norm", "softmax_norm")
assert NORM_EPS == 1e-12  # written as a literal in the kernels


def available() -> bool:
    """True when the Triton kernels can run here: triton imports and either CUDA is available or
    ``TRITON_INTERPRET=1`` (the CPU interpreter). Never raises."""
    try:
        if triton is None:
            return False
        return bool(torch.cuda.is_available()) or os.environ.get("TRITON_INTERPRET") == "1"
    except Exception:
        return False


# ============================================================================================
# layer 1: kernels
# ============================================================================================
@_jit
def _last_le(cu_ptr, t, n_seg, n_search):
    """Largest ``s`` in ``[0, n_seg)`` with ``cu[s] <= t`` (``cu`` non-decreasing, ``cu[0] == 0``).

    ``n_search >= ceil(log2(n_seg))`` iterations of a branch-free binary search; scalar loads of
    the offsets, which every program shares, so they stay in L1/L2.
    """
    lo = tl.program_id(0) * 0  # int32 scalar tensors (not constexprs: they are loop-carried)
    hi = lo + (n_seg - 1)
    for _ in range(n_search):
        mid = (lo + hi + 1) // 2
        go = tl.load(cu_ptr + mid).to(tl.int64) <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@_jit
def _locate_piece(pid, cu_ptr, n_seg, n_search, PIECE: tl.constexpr):
    """Program id -> the piece it reduces: (seg, lo, hi, seg_lo, seg_hi, is_head, valid).

    Rows ``[lo, hi)`` of segment ``seg`` (which owns rows ``[seg_lo, seg_hi)``). Head programs
    (``pid < n_seg``) own the segment's first piece and are always valid (an empty segment still
    gets its zero row written); tile program ``j = pid - n_seg`` owns the piece that starts in
    ``[j * PIECE, (j + 1) * PIECE)`` at a multiple of PIECE past its segment's start, if any.
    """
    is_head = pid < n_seg
    t = (pid - n_seg).to(tl.int64) * PIECE
    if is_head:
        seg = pid
    else:
        seg = _last_le(cu_ptr, t, n_seg, n_search)
    seg_lo = tl.load(cu_ptr + seg).to(tl.int64)
    seg_hi = tl.load(cu_ptr + seg + 1).to(tl.int64)
    # k = index of the first piece of `seg` starting at or after t (non-negative operands only)
    k = (tl.where(is_head, 0, t - seg_lo) + PIECE - 1) // PIECE
    lo = seg_lo + k * PIECE
    hi = tl.minimum(seg_hi, lo + PIECE)
    valid = is_head | ((t > seg_lo) & (lo < hi))
    return seg, lo, hi, seg_lo, seg_hi, is_head, valid


@_jit
def _segment_reduce_kernel(
    x_ptr,  # (n_rows, H) rows, stride_x apart, unit column stride; fp32 / bf16 / fp16
    stride_x,
    cu_ptr,  # (n_seg + 1,) int32 or int64 offsets
    coef_ptr,  # (n_rows,) fp32 per-row coefficient (read only when HAS_COEF)
    out_ptr,  # (n_seg, H) fp32: final rows, or the head partial of multi-piece segments
    part_ptr,  # (cdiv(n_rows, PIECE), H) fp32 workspace: tile-piece partials
    sq_ptr,  # (n_seg, n_hblocks) fp32: per-column-block sums of squares (WRITE_SQ)
    n_seg,
    H,
    n_hblocks,
    n_search,
    PIECE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_MAX: tl.constexpr,  # False: sum (of coef * x); True: element-wise max (of coef * x)
    HAS_COEF: tl.constexpr,
    DIVIDE_BY_LEN: tl.constexpr,  # mean: the finished sum is divided by the segment length
    WRITE_SQ: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    seg, lo, hi, seg_lo, seg_hi, is_head, valid = _locate_piece(pid, cu_ptr, n_seg, n_search, PIECE)
    if not valid:
        return
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    r_offs = tl.arange(0, BLOCK_R)
    if IS_MAX:
        acc = tl.full([BLOCK_R, BLOCK_H], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + r_offs  # int64
        rmask = rows < hi
        m2 = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_COEF:
            w = tl.load(coef_ptr + rows, mask=rmask, other=0.0)
            x = x * w[:, None]
        if IS_MAX:
            acc = tl.maximum(acc, tl.where(m2, x, float("-inf")))
        else:
            acc += x
    n = seg_hi - seg_lo
    if IS_MAX:
        res = tl.where(cmask, tl.max(acc, axis=0), 0.0)
        if n == 0:  # an out-of-contract empty document: zeros, like the reference
            res = tl.zeros([BLOCK_H], tl.float32)
    else:
        res = tl.sum(acc, axis=0)
    out_offs = seg.to(tl.int64) * H + cols
    if hi - lo == n:  # the whole segment is this piece: finish it here
        if DIVIDE_BY_LEN:
            res = res / tl.maximum(n, 1).to(tl.float32)
        tl.store(out_ptr + out_offs, res, mask=cmask)
        if WRITE_SQ:
            tl.store(sq_ptr + seg.to(tl.int64) * n_hblocks + pid_h, tl.sum(res * res, axis=0))
    elif is_head:
        tl.store(out_ptr + out_offs, res, mask=cmask)
    else:
        tl.store(part_ptr + (pid - n_seg).to(tl.int64) * H + cols, res, mask=cmask)


@_jit
def _segment_finalize_kernel(
    cu_ptr,
    out_ptr,  # (n_seg, H) fp32, holds the head partials
    part_ptr,  # (cdiv(n_rows, PIECE), H) fp32 tile partials
    sq_ptr,
    H,
    n_hblocks,
    PIECE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_MAX: tl.constexpr,
    DIVIDE_BY_LEN: tl.constexpr,
    WRITE_SQ: tl.constexpr,
):
    """Combine the pieces of segments longer than PIECE, in piece order (deterministic)."""
    seg = tl.program_id(0)
    pid_h = tl.program_id(1)
    seg_lo = tl.load(cu_ptr + seg).to(tl.int64)
    seg_hi = tl.load(cu_ptr + seg + 1).to(tl.int64)
    n = seg_hi - seg_lo
    n_pieces = (n + PIECE - 1) // PIECE
    if n_pieces <= 1:  # finished by its head program
        return
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    out_offs = seg.to(tl.int64) * H + cols
    acc = tl.load(out_ptr + out_offs, mask=cmask, other=0.0)
    # piece k >= 1 of this segment sits in workspace row seg_lo // PIECE + k (see _locate_piece)
    j0 = seg_lo // PIECE
    for k in range(1, n_pieces):
        v = tl.load(part_ptr + (j0 + k) * H + cols, mask=cmask, other=0.0)
        if IS_MAX:
            acc = tl.maximum(acc, v)
        else:
            acc += v
    if DIVIDE_BY_LEN:
        acc = acc / n.to(tl.float32)
    tl.store(out_ptr + out_offs, acc, mask=cmask)
    if WRITE_SQ:
        acc = tl.where(cmask, acc, 0.0)
        tl.store(sq_ptr + seg.to(tl.int64) * n_hblocks + pid_h, tl.sum(acc * acc, axis=0))


@_jit
def _gather_rows_kernel(
    x_ptr,
    stride_x,
    cu_ptr,
    out_ptr,
    n_rows,
    H,
    LAST: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """cls / last pooling: out[c] = x[cu[c]] or x[cu[c + 1] - 1], as float32."""
    c = tl.program_id(0)
    pid_h = tl.program_id(1)
    if LAST:
        row = tl.load(cu_ptr + c + 1).to(tl.int64) - 1
    else:
        row = tl.load(cu_ptr + c).to(tl.int64)
    # clamp: only an out-of-contract empty chunk could point outside hidden
    row = tl.minimum(tl.maximum(row, 0), n_rows - 1)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + c.to(tl.int64) * H + cols, x, mask=cmask)


@_jit
def _row_norm_kernel(
    x_ptr,  # (n_rows, H) fp32
    stride_x,
    norm_ptr,  # (n_rows,) fp32 out: L2 norm of each row
    n_rows,
    H,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m2 = rmask[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m2, other=0.0)
        acc += x * x
    tl.store(norm_ptr + rows, tl.sqrt(tl.sum(acc, axis=1)), mask=rmask)


@_jit
def _doc_coef_kernel(
    norm_ptr,  # (n_chunks,) fp32 chunk norms (read when NEEDS_NORM)
    w_ptr,  # (n_chunks,) fp32 chunk weights (weighted_mean)
    cu_ptr,  # (n_docs + 1,) int64
    coef_ptr,  # (n_chunks,) fp32 out
    n_seg,
    n_search,
    top_k,
    temperature,
    AGG: tl.constexpr,
    NORMALIZE_CHUNKS: tl.constexpr,
    NEEDS_NORM: tl.constexpr,
    PIECE: tl.constexpr,  # chunks per program (= BLOCK_C)
    BLOCK_J: tl.constexpr,  # chunks per step when scanning the whole document
):
    """One float32 coefficient per chunk: the document vector is sum_i coef_i * chunk_i (or the
    max of coef_i * chunk_i), ``coef`` folding in 1 / max(norm, eps) under normalize_chunks."""
    pid = tl.program_id(0)
    seg, lo, hi, seg_lo, seg_hi, is_head, valid = _locate_piece(pid, cu_ptr, n_seg, n_search, PIECE)
    if valid & (lo < hi):
        rows = lo + tl.arange(0, PIECE)
        rmask = rows < hi
        m = seg_hi - seg_lo
        if NEEDS_NORM:
            nrm = tl.load(norm_ptr + rows, mask=rmask, other=1.0)
        else:
            nrm = tl.full([PIECE], 1.0, tl.float32)
        if NORMALIZE_CHUNKS:
            inv = 1.0 / tl.maximum(nrm, 1e-12)
        else:
            inv = tl.full([PIECE], 1.0, tl.float32)
        j_offs = tl.arange(0, BLOCK_J)
        if AGG == 0:  # mean
            coef = inv / m.to(tl.float32)
        elif AGG == 1:  # weighted_mean: w_i / max(sum_j w_j, eps)
            wsum = tl.zeros([BLOCK_J], tl.float32)
            for j0 in range(seg_lo, seg_hi, BLOCK_J):
                js = j0 + j_offs
                wsum += tl.load(w_ptr + js, mask=js < seg_hi, other=0.0)
            total = tl.maximum(tl.sum(wsum, axis=0), 1e-12)
            coef = tl.load(w_ptr + rows, mask=rmask, other=0.0) / total * inv
        elif AGG == 2:  # max
            coef = inv
        elif AGG == 3:  # topk_norm: chunk i is kept iff fewer than top_k chunks rank before it
            ni = nrm  # salience: the norm as pooled, also under normalize_chunks (spec)
            rank = tl.zeros([PIECE], tl.int32)
            for j0 in range(seg_lo, seg_hi, BLOCK_J):
                js = j0 + j_offs
                jmask = js < seg_hi
                nj = tl.load(norm_ptr + js, mask=jmask, other=0.0)
                before = (nj[None, :] > ni[:, None]) | ((nj[None, :] == ni[:, None]) & (js[None, :] < rows[:, None]))
                rank += tl.sum((before & jmask[None, :]).to(tl.int32), axis=1)
            kept = tl.minimum(m, top_k).to(tl.float32)
            coef = tl.where(rank < top_k, inv / kept, 0.0)
        else:  # softmax_norm: weights exp((n_i - max n) / T) / sum_j exp((n_j - max n) / T)
            ni = nrm  # salience: the norm as pooled, also under normalize_chunks (spec)
            mx = tl.full([BLOCK_J], float("-inf"), tl.float32)
            for j0 in range(seg_lo, seg_hi, BLOCK_J):
                js = j0 + j_offs
                nj = tl.load(norm_ptr + js, mask=js < seg_hi, other=0.0)
                mx = tl.maximum(mx, tl.where(js < seg_hi, nj, float("-inf")))
            top = tl.max(mx, axis=0)
            z = tl.zeros([BLOCK_J], tl.float32)
            for j0 in range(seg_lo, seg_hi, BLOCK_J):
                js = j0 + j_offs
                nj = tl.load(norm_ptr + js, mask=js < seg_hi, other=0.0)
                z += tl.where(js < seg_hi, tl.exp((nj - top) / temperature), 0.0)
            coef = tl.exp((ni - top) / temperature) / tl.sum(z, axis=0) * inv
        tl.store(coef_ptr + rows, coef, mask=rmask)


@_jit
def _normalize_rows_kernel(
    out_ptr,  # (n_seg, H) fp32, normalised in place
    sq_ptr,  # (n_seg, n_hblocks) fp32 sums of squares per column block
    H,
    n_hblocks,
    BLOCK_H: tl.constexpr,
    BLOCK_NHB: tl.constexpr,
):
    seg = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    b = tl.arange(0, BLOCK_NHB)
    sq = tl.load(sq_ptr + seg * n_hblocks + b, mask=b < n_hblocks, other=0.0)
    denom = tl.maximum(tl.sqrt(tl.sum(sq, axis=0)), 1e-12)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    x = tl.load(out_ptr + seg * H + cols, mask=cmask, other=0.0)
    tl.store(out_ptr + seg * H + cols, x / denom, mask=cmask)


# ============================================================================================
# layer 2: launchers (every launch parameter comes from _launch_config)
# ============================================================================================
# Rows per piece (the most any program reduces). Token pooling: 256 tokens x BLOCK_H is 256 KiB
# of bf16 per program (at BLOCK_H = 512), enough to amortise the program's start and the binary
# search of tile programs, small enough that one 8192-token chunk spreads over 32 x (H / BLOCK_H)
# programs. Each extra piece costs 8 * H bytes (partial written + read), 1.6 % of its 256 * 2 * H
# bytes of bf16 input. Documents: pieces of 64 chunk rows (chunks are few; spread them wider).
POOL_PIECE = 256
DOC_PIECE = 64
# _doc_coef_kernel: 128 chunks per program, scanning the document 32 chunks per step: the top-k
# rank tile is [128, 32] (32 comparisons per thread at 4 warps); a [128, 128] tile spilled
# (255 registers + 880 B of stack in the sm_90 compile report).
COEF_PIECE = 128
COEF_BLOCK_J = 32
# bytes of hidden state each program loads per loop step: 16 KiB = 32 elements (4-8 16-byte
# vector loads) per thread at the warp counts below, enough independent loads in flight per SM
# with several programs resident.
TILE_BYTES = 16 * 1024
ROW_BYTES = 1024  # widest column block: 1 KiB of a row (512 bf16 / 256 fp32 elements)


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes of the segmented reduction for one (hidden size, element size)."""

    block_h: int  # columns per program (a power of two)
    block_r: int  # rows per loop step
    num_warps: int
    piece: int  # rows per piece (multiple of block_r)


def _launch_config(hidden_size: int, elem_bytes: int, piece: int) -> LaunchConfig:
    """The one place launch parameters are chosen.

    BLOCK_H: the widest of 1 KiB, 512 B and 256 B of a row (and no wider than the row rounded up
    to a power of two) that pads H the least: 384 -> 128 (3 blocks, no padding), 3584 -> 512 (7),
    4096 -> 512 bf16 / 256 fp32, 100 -> 128, 1000 -> 256 fp32 / 512 bf16. BLOCK_R fills
    TILE_BYTES (16 rows of 1 KiB, up to 64 rows for narrow blocks); num_warps gives each thread 32
    elements of a tile.
    """
    widest = ROW_BYTES // elem_bytes
    p2 = max(16, 1 << max(0, hidden_size - 1).bit_length())  # H rounded up to a power of two
    cands = sorted({min(c, p2) for c in (widest, widest // 2, widest // 4)}, reverse=True)
    block_h = min(cands, key=lambda b: (math.ceil(hidden_size / b) * b, -b))
    block_r = max(4, min(64, TILE_BYTES // (block_h * elem_bytes)))
    num_warps = max(1, min(8, (block_r * block_h) // 1024))
    piece = max(block_r, (piece // block_r) * block_r)
    return LaunchConfig(block_h=block_h, block_r=block_r, num_warps=num_warps, piece=piece)


def _require_runtime(t: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(
            f"the Triton pooling kernels need triton (pip install triton): {_TRITON_IMPORT_ERROR!r}"
        )
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"the Triton pooling kernels run on CUDA tensors (or on the CPU with TRITON_INTERPRET=1 "
            f"set before triton is imported); got a tensor on {t.device}"
        )


def _device_guard(t: torch.Tensor):
    """Launch on the tensors' GPU even when another one is current."""
    import contextlib

    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _rows_unit_stride(x: torch.Tensor) -> torch.Tensor:
    # rows may be strided (a row slice of a larger buffer); columns must be contiguous
    return x if (x.stride(1) == 1 or x.shape[1] <= 1) else x.contiguous()


def _n_search(n_seg: int) -> int:
    return max(1, (n_seg - 1).bit_length())


def _segment_reduce(
    x: torch.Tensor,
    cu: torch.Tensor,
    out: torch.Tensor,
    cfg: LaunchConfig,
    *,
    coef: Optional[torch.Tensor],
    is_max: bool,
    divide_by_len: bool,
    sq: Optional[torch.Tensor],
) -> None:
    """out[s] = reduce over rows cu[s]:cu[s+1] of x (see the module notes); sq gets the
    per-column-block sums of squares of out when given."""
    n_rows, H = x.shape
    n_seg = cu.numel() - 1
    n_hb = triton.cdiv(H, cfg.block_h)
    multi = n_rows > cfg.piece  # only then can a segment span more than one piece
    n_tiles = triton.cdiv(n_rows, cfg.piece) if multi else 0
    part = out.new_empty((n_tiles, H)) if multi else out  # `out` stands in for unused pointers
    coef_arg = coef if coef is not None else out
    sq_arg = sq if sq is not None else out
    consts = dict(IS_MAX=is_max, DIVIDE_BY_LEN=divide_by_len, WRITE_SQ=sq is not None)
    _segment_reduce_kernel[(n_seg + n_tiles, n_hb)](
        x, x.stride(0), cu, coef_arg, out, part, sq_arg,
        n_seg, H, n_hb, _n_search(n_seg),
        PIECE=cfg.piece, BLOCK_R=cfg.block_r, BLOCK_H=cfg.block_h, HAS_COEF=coef is not None,
        num_warps=cfg.num_warps, **consts,
    )  # fmt: skip
    if multi:
        _segment_finalize_kernel[(n_seg, n_hb)](
            cu, out, part, sq_arg, H, n_hb, PIECE=cfg.piece, BLOCK_H=cfg.block_h, num_warps=4, **consts
        )


def _pool_chunks_launch(
    hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str, cfg: Optional[LaunchConfig] = None
) -> torch.Tensor:
    """Host launcher of `pool_chunks_triton` (``cfg`` overrides the block sizes, for tests)."""
    code = check_pool_chunks_inputs(hidden, cu_seqlens, pooling)
    n_chunks, H = cu_seqlens.numel() - 1, hidden.shape[1]
    out = torch.empty((n_chunks, H), dtype=torch.float32, device=hidden.device)
    if n_chunks == 0 or H == 0:
        return out
    _require_runtime(hidden)
    hidden = _rows_unit_stride(hidden)
    cu = cu_seqlens.contiguous()
    if cfg is None:
        cfg = _launch_config(H, hidden.element_size(), POOL_PIECE)
    with _device_guard(hidden):
        if code in (_CLS, _LAST):
            # one row per chunk: a gather, 1 KiB row blocks, no loop
            _gather_rows_kernel[(n_chunks, triton.cdiv(H, cfg.block_h))](
                hidden, hidden.stride(0), cu, out, hidden.shape[0], H,
                LAST=code == _LAST, BLOCK_H=cfg.block_h, num_warps=4,
            )  # fmt: skip
        else:
            _segment_reduce(hidden, cu, out, cfg, coef=None, is_max=False, divide_by_len=True, sq=None)
    return out


def _aggregate_launch(
    chunks: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: Optional[torch.Tensor],
    aggregation: str,
    top_k: int,
    temperature: float,
    normalize_chunks: bool,
    normalize: bool,
    cfg: Optional[LaunchConfig] = None,
) -> torch.Tensor:
    """Host launcher of `aggregate_documents_triton` (``cfg`` overrides the block sizes, for tests)."""
    agg = check_aggregate_inputs(chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature)
    n_chunks, H = chunks.shape
    n_docs = cu_doc_chunks.numel() - 1
    if n_docs == 0 or H == 0 or n_chunks == 0:
        # no rows to read (an out-of-contract empty document aggregates to zeros, like the ref)
        return torch.zeros((n_docs, H), dtype=torch.float32, device=chunks.device)
    _require_runtime(chunks)
    chunks = _rows_unit_stride(chunks)
    cu = cu_doc_chunks.contiguous()
    if cfg is None:
        cfg = _launch_config(H, 4, DOC_PIECE)
    needs_norm = normalize_chunks or agg in (_AGG_TOPK, _AGG_SOFTMAX)
    needs_coef = normalize_chunks or agg in (_AGG_WMEAN, _AGG_TOPK, _AGG_SOFTMAX)
    dev = chunks.device
    out = torch.empty((n_docs, H), dtype=torch.float32, device=dev)
    n_hb = triton.cdiv(H, cfg.block_h)
    sq = torch.empty((n_docs, n_hb), dtype=torch.float32, device=dev) if normalize else None
    with _device_guard(chunks):
        coef = None
        if needs_coef:
            norms = out  # placeholder pointer when not read
            if needs_norm:
                norms = torch.empty((n_chunks,), dtype=torch.float32, device=dev)
                _row_norm_kernel[(triton.cdiv(n_chunks, cfg.block_r),)](
                    chunks, chunks.stride(0), norms, n_chunks, H,
                    BLOCK_R=cfg.block_r, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps,
                )  # fmt: skip
            weights = chunk_weights.contiguous() if chunk_weights is not None else norms
            coef = torch.empty((n_chunks,), dtype=torch.float32, device=dev)
            n_tiles = triton.cdiv(n_chunks, COEF_PIECE) if n_chunks > COEF_PIECE else 0
            _doc_coef_kernel[(n_docs + n_tiles,)](
                norms, weights, cu, coef, n_docs, _n_search(n_docs),
                min(int(top_k), n_chunks), float(temperature),
                AGG=agg, NORMALIZE_CHUNKS=bool(normalize_chunks), NEEDS_NORM=needs_norm,
                PIECE=COEF_PIECE, BLOCK_J=COEF_BLOCK_J, num_warps=4,
            )  # fmt: skip
        _segment_reduce(
            chunks, cu, out, cfg,
            coef=coef, is_max=agg == _AGG_MAX, divide_by_len=(agg == _AGG_MEAN and coef is None), sq=sq,
        )  # fmt: skip
        if normalize:
            _normalize_rows_kernel[(n_docs, n_hb)](
                out, sq, H, n_hb, BLOCK_H=cfg.block_h, BLOCK_NHB=max(2, triton.next_power_of_2(n_hb)), num_warps=4
            )
    return out


# ============================================================================================
# layer 3: registered ops (opaque to torch.compile, with fake implementations) and the API
# ============================================================================================
# Both ops are declared from the schema strings of `spec.SCHEMAS` (the one argument list of each op,
# defaults included); the Python signatures below repeat it, and tests/ops/test_dispatch.py checks
# that they do. The dispatcher drops trailing arguments left at their defaults, so the kernels'
# Python defaults are used too.
@torch.library.custom_op("dice_fast::pool_chunks_triton", mutates_args=(), schema=SCHEMAS["pool_chunks"])
def _pool_chunks_op(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    return _pool_chunks_launch(hidden, cu_seqlens, pooling)


@_pool_chunks_op.register_fake
def _pool_chunks_fake(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    check_pool_chunks_inputs(hidden, cu_seqlens, pooling)
    return hidden.new_empty((cu_seqlens.shape[0] - 1, hidden.shape[1]), dtype=torch.float32)


@torch.library.custom_op(
    "dice_fast::aggregate_documents_triton", mutates_args=(), schema=SCHEMAS["aggregate_documents"]
)
def _aggregate_op(
    chunks: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: Optional[torch.Tensor] = None,
    aggregation: str = "mean",
    top_k: int = 1,
    temperature: float = 1.0,
    normalize_chunks: bool = False,
    normalize: bool = True,
) -> torch.Tensor:
    return _aggregate_launch(
        chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature, normalize_chunks, normalize
    )


@_aggregate_op.register_fake
def _aggregate_fake(
    chunks: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: Optional[torch.Tensor] = None,
    aggregation: str = "mean",
    top_k: int = 1,
    temperature: float = 1.0,
    normalize_chunks: bool = False,
    normalize: bool = True,
) -> torch.Tensor:
    check_aggregate_inputs(chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature)
    return chunks.new_empty((cu_doc_chunks.shape[0] - 1, chunks.shape[1]), dtype=torch.float32)


def pool_chunks_triton(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """Token states -> one float32 vector per chunk (the op ``dice_fast::pool_chunks_triton``).

    hidden: (total_tokens, hidden_size) float32 / bfloat16 / float16, unit column stride;
    cu_seqlens: (n_chunks + 1,) int32 on hidden's device. Returns (n_chunks, hidden_size) float32.
    ``pooling``: mean | cls | last. Raises ValueError on bad arguments (before any launch).
    """
    check_pool_chunks_inputs(hidden, cu_seqlens, pooling)
    return torch.ops.dice_fast.pool_chunks_triton(hidden, cu_seqlens, pooling)


def aggregate_documents_triton(
    chunks: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: Optional[torch.Tensor] = None,
    aggregation: str = "mean",
    top_k: int = 1,
    temperature: float = 1.0,
    normalize_chunks: bool = False,
    normalize: bool = True,
) -> torch.Tensor:
    """Chunk vectors -> one float32 vector per document (``dice_fast::aggregate_documents_triton``).

    chunks: (n_chunks, hidden_size) float32; cu_doc_chunks: (n_docs + 1,) int64; chunk_weights:
    (n_chunks,) float32, needed by ``weighted_mean``. Returns (n_docs, hidden_size) float32.
    Modes and flags as `dice_fast.ops.spec.aggregate_documents_ref`. Raises ValueError on bad
    arguments (before any launch).
    """
    check_aggregate_inputs(chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature)
    return torch.ops.dice_fast.aggregate_documents_triton(
        chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature, normalize_chunks, normalize
    )
