"""The packer: chunks -> flat varlen batches under a token budget.

Each chunk is wrapped exactly like a standalone input of the model (``prefix`` = the tokenizer's
special prefix + the tokenized document/query prefix, ``suffix`` = the special suffix), and the
wrapped chunks of one batch are laid back to back in one sequence:

* ``input_ids`` (T,) int64, ``position_ids`` (T,) int64 restarting at ``first_position`` in every
  chunk ("local") or continuing from the chunk's offset in its document ("global", the ablation);
* ``cu_seqlens`` (n + 1,) int32 with a leading 0, and ``max_seqlen`` as a host int;
* ``chunk_ids`` (n,) int64: which plan chunk each packed sequence is. Within a batch chunks are
  ordered by decreasing length (stable), so runs of equal-length chunks are contiguous (the CPU
  attention backend batches each run in one dense call); results are scattered back by chunk_ids.

Late chunking (`pack_windows`) packs windows instead: the sequences are wrapped windows (positions
restarting per window), and the pooled segments are the chunk spans inside them: ``pool_rows`` (R,)
int64 rows of the batch's tokens, ``pool_cu`` (n + 1,) int32 segments over those rows, ``pool_seq``
(n,) int64 the sequence each segment lies in (non-decreasing); ``chunk_ids`` then names the pooled
segments, not the sequences. A chunk whose pooling leaves its leading tokens out (``unpooled``: a
prompt under include_prompt false) is the segment of its sequence after them. Every segment is a run of
consecutive rows of one sequence. Without them (None) every sequence is one pooled chunk.

All index arithmetic is vectorised numpy; the only Python loop is over batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from .chunking import ChunkPlan, EncodingPlan, TokenizedDocuments
from .text_prefix import prompt_left_out


@dataclass(frozen=True)
class PackedBatch:
    """One forward's worth of packed chunks (see the module docstring for shapes)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    max_seqlen: int
    chunk_ids: np.ndarray
    lengths: np.ndarray
    pool_rows: np.ndarray | None = None
    pool_cu: np.ndarray | None = None
    pool_seq: np.ndarray | None = None
    # the int arrays already on the model's device (`dice_fast.pipeline.Staged`), or None
    staged: object = field(default=None, repr=False, compare=False)

    @property
    def n_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def n_chunks(self) -> int:
        """Chunk vectors the batch pools (its sequences, unless it pools segments inside them)."""
        return len(self.chunk_ids)

    def segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pool_rows, pool_cu, pool_seq), filled in for a batch that pools whole sequences."""
        if self.pool_rows is not None:
            return self.pool_rows, self.pool_cu, self.pool_seq
        return (np.arange(self.n_tokens, dtype=np.int64), self.cu_seqlens,
                np.arange(len(self.lengths), dtype=np.int64))

    def chunk_rows(self, lo: int, hi: int) -> tuple[int, int]:
        """[first, last) pooled chunks lying in sequences ``lo:hi``."""
        if self.pool_seq is None:
            return lo, hi
        return (int(np.searchsorted(self.pool_seq, lo, side="left")),
                int(np.searchsorted(self.pool_seq, hi, side="left")))


def pack(
    docs: TokenizedDocuments,
    plan: ChunkPlan,
    chunk_ids: np.ndarray,
    prefix: np.ndarray,
    suffix: np.ndarray,
    first_position: int,
    global_positions: bool = False,
    unpooled: int = 0,
) -> PackedBatch:
    """Pack the plan chunks ``chunk_ids`` (n,) into one varlen batch.

    prefix, suffix: int64 token ids put around every chunk's content. The work is proportional to
    the batch's tokens: only the batch's own token ids are read, never the whole corpus. ``unpooled``:
    leading tokens of every wrapped chunk its pooling leaves out (at most all but its last); the
    batch then pools those segments (``pool_rows``), one per sequence.
    """
    n_pre, n_suf = len(prefix), len(suffix)
    content = plan.length[chunk_ids]
    lengths = content + (n_pre + n_suf)
    order = np.argsort(-lengths, kind="stable")
    chunk_ids, content, lengths = chunk_ids[order], content[order], lengths[order]

    cu = np.zeros(len(chunk_ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    total = int(cu[-1])
    # r: position of every token inside its wrapped chunk
    r = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lengths)
    content_rep = np.repeat(content, lengths)
    input_ids = np.empty(total, dtype=np.int64)
    is_pre = r < n_pre
    is_text = ~is_pre & (r < n_pre + content_rep)
    is_suf = ~(is_pre | is_text)
    starts = np.repeat(docs.offsets[plan.document[chunk_ids]] + plan.start[chunk_ids], lengths)
    input_ids[is_text] = docs.ids[starts[is_text] + (r[is_text] - n_pre)]
    input_ids[is_pre] = np.asarray(prefix, np.int64)[r[is_pre]]
    input_ids[is_suf] = np.asarray(suffix, np.int64)[(r - n_pre - content_rep)[is_suf]]
    position_ids = r + first_position
    if global_positions:
        position_ids += np.repeat(plan.start[chunk_ids], lengths)
    batch = PackedBatch(input_ids, position_ids, cu.astype(np.int32), int(lengths.max()) if len(lengths) else 0,
                        chunk_ids, lengths)
    if not unpooled:
        return batch
    skip = prompt_left_out(unpooled, lengths)
    rows, pool_cu = _rows(cu[:-1] + skip, lengths - skip)
    return dataclasses.replace(batch, pool_rows=rows, pool_cu=pool_cu, pool_seq=np.arange(len(lengths), dtype=np.int64))


def _rows(first: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pool_rows, pool_cu) of the segments of ``count`` consecutive rows from ``first`` (n,) each."""
    pool_cu = np.zeros(len(count) + 1, dtype=np.int64)
    np.cumsum(count, out=pool_cu[1:])
    rows = np.repeat(first - pool_cu[:-1], count) + np.arange(int(pool_cu[-1]), dtype=np.int64)
    return rows, pool_cu.astype(np.int32)


def pack_plan(plan: EncodingPlan, chunk_ids: np.ndarray, first_position: int) -> PackedBatch:
    """``plan``'s chunks ``chunk_ids`` packed as the engine runs them: their windows under late chunking
    (`pack_windows`), else each chunk wrapped (`pack`) with the plan's positions and the tokens its
    pooling leaves out."""
    if plan.windows is not None:
        return pack_windows(plan, chunk_ids, first_position)
    return pack(plan.tokens, plan.chunks, chunk_ids, plan.prefix, plan.suffix, first_position, plan.global_positions,
                plan.unpooled)


def pack_windows(plan: EncodingPlan, chunk_ids: np.ndarray, first_position: int) -> PackedBatch:
    """Pack the windows of a late-chunking ``plan``'s chunks ``chunk_ids`` (n,) into one varlen batch,
    each window once (wrapped, positions restarting), pooling those chunks' spans inside them (see the
    module docstring)."""
    w = plan.windows
    chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
    windows = np.unique(w.chunk_window[chunk_ids])
    batch = pack(plan.tokens, w.as_chunks(), windows, plan.prefix, plan.suffix, first_position)
    seq_of_window = np.empty(len(windows), dtype=np.int64)  # over this batch's windows only (sorted)
    seq_of_window[np.searchsorted(windows, batch.chunk_ids)] = np.arange(len(batch.chunk_ids))
    seq = seq_of_window[np.searchsorted(windows, w.chunk_window[chunk_ids])]
    order = np.argsort(seq, kind="stable")
    chunk_ids, seq = chunk_ids[order], seq[order]
    ch = plan.chunks
    cu = batch.cu_seqlens.astype(np.int64)
    text = ch.length[chunk_ids] > 0
    skip = prompt_left_out(plan.unpooled, batch.lengths[seq])  # no text: the window less its prompt
    first = np.where(text, cu[seq] + len(plan.prefix) + ch.start[chunk_ids] - w.start[w.chunk_window[chunk_ids]],
                     cu[seq] + skip)
    count = np.where(text, ch.length[chunk_ids], batch.lengths[seq] - skip)
    rows, pool_cu = _rows(first, count)
    return dataclasses.replace(batch, chunk_ids=chunk_ids, pool_rows=rows, pool_cu=pool_cu, pool_seq=seq)


def merge(parts: list[PackedBatch]) -> tuple[PackedBatch, np.ndarray]:
    """One batch of the chunks of several packed ``parts`` (e.g. of different requests), again
    ordered by decreasing length. Returns the batch and ``part`` (n,) int64: which part each of its
    chunks came from (its ``chunk_ids`` stay the indices within that part's plan)."""
    if len(parts) == 1:
        return parts[0], np.zeros(parts[0].n_chunks, dtype=np.int64)
    lengths = np.concatenate([p.lengths for p in parts])
    part = np.repeat(np.arange(len(parts), dtype=np.int64), [len(p.lengths) for p in parts])
    starts = np.concatenate([p.cu_seqlens[:-1].astype(np.int64) + off for p, off in
                             zip(parts, np.cumsum([0] + [p.n_tokens for p in parts[:-1]]))])
    order = np.argsort(-lengths, kind="stable")
    lengths, part, starts = lengths[order], part[order], starts[order]
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    gather = np.repeat(starts - cu[:-1], lengths) + np.arange(int(cu[-1]), dtype=np.int64)
    batch = PackedBatch(
        input_ids=np.concatenate([p.input_ids for p in parts])[gather],
        position_ids=np.concatenate([p.position_ids for p in parts])[gather],
        cu_seqlens=cu.astype(np.int32),
        max_seqlen=int(lengths.max()) if len(lengths) else 0,
        chunk_ids=np.concatenate([p.chunk_ids for p in parts])[order],
        lengths=lengths,
    )
    if all(p.pool_rows is None for p in parts):
        return batch, part
    return _merge_segments(parts, batch, gather, order)


def _merge_segments(parts, batch: PackedBatch, gather, order) -> tuple[PackedBatch, np.ndarray]:
    """`merge` where some part pools segments inside its sequences (late chunking): ``batch`` holds the
    merged sequences as `merge` orders them; every part's segments move with their tokens, ordered by
    sequence."""
    new_token = np.empty(len(gather), dtype=np.int64)
    new_token[gather] = np.arange(len(gather), dtype=np.int64)  # old token row -> new row
    new_seq = np.empty(len(order), dtype=np.int64)
    new_seq[order] = np.arange(len(order), dtype=np.int64)
    rows, counts, seqs, ids, part = [], [], [], [], []
    tok_base = seq_base = 0
    for j, p in enumerate(parts):
        r, pcu, sq = p.segments()
        rows.append(new_token[r + tok_base])
        counts.append(np.diff(pcu.astype(np.int64)))
        seqs.append(new_seq[sq + seq_base])
        ids.append(p.chunk_ids)
        part.append(np.full(len(p.chunk_ids), j, dtype=np.int64))
        tok_base, seq_base = tok_base + p.n_tokens, seq_base + len(p.lengths)
    seq = np.concatenate(seqs)
    by_seq = np.argsort(seq, kind="stable")
    count = np.concatenate(counts)
    seg_cu = np.zeros(len(count) + 1, dtype=np.int64)
    np.cumsum(count, out=seg_cu[1:])
    flat = np.concatenate(rows)
    pool_cu = np.zeros(len(count) + 1, dtype=np.int64)
    np.cumsum(count[by_seq], out=pool_cu[1:])
    take = np.repeat(seg_cu[:-1][by_seq] - pool_cu[:-1], count[by_seq]) + np.arange(int(pool_cu[-1]), dtype=np.int64)
    batch = dataclasses.replace(batch, chunk_ids=np.concatenate(ids)[by_seq], pool_rows=flat[take],
                                pool_cu=pool_cu.astype(np.int32), pool_seq=seq[by_seq])
    return batch, np.concatenate(part)[by_seq]
