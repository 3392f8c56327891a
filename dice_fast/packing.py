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

All index arithmetic is vectorised numpy; the only Python loop is over batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .chunking import ChunkPlan, TokenizedDocuments


@dataclass(frozen=True)
class PackedBatch:
    """One forward's worth of packed chunks (see the module docstring for shapes)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    max_seqlen: int
    chunk_ids: np.ndarray
    lengths: np.ndarray
    # the int arrays already on the model's device (`dice_fast.pipeline.Staged`), or None
    staged: object = field(default=None, repr=False, compare=False)

    @property
    def n_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


def pack(
    docs: TokenizedDocuments,
    plan: ChunkPlan,
    chunk_ids: np.ndarray,
    prefix: np.ndarray,
    suffix: np.ndarray,
    first_position: int,
    global_positions: bool = False,
) -> PackedBatch:
    """Pack the plan chunks ``chunk_ids`` (n,) into one varlen batch.

    prefix, suffix: int64 token ids put around every chunk's content. The work is proportional to
    the batch's tokens: only the batch's own token ids are read, never the whole corpus.
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
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu.astype(np.int32),
        max_seqlen=int(lengths.max()) if len(lengths) else 0,
        chunk_ids=chunk_ids,
        lengths=lengths,
    )


def merge(parts: list[PackedBatch]) -> tuple[PackedBatch, np.ndarray]:
    """One batch of the chunks of several packed ``parts`` (e.g. of different requests), again
    ordered by decreasing length. Returns the batch and ``part`` (n,) int64: which part each of its
    chunks came from (its ``chunk_ids`` stay the indices within that part's plan)."""
    if len(parts) == 1:
        return parts[0], np.zeros(len(parts[0].lengths), dtype=np.int64)
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
    return batch, part
