"""What `DiceEncoder.encode_documents` returns with ``return_chunks=True``: `DiceOutput`, built from an
encoding plan and its vectors (`DiceOutput.of_plan`), and the joining of per-window results of a stream
(`concat_outputs`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .chunking import EncodingPlan


@dataclass(frozen=True)
class DiceOutput:
    """Result of ``encode_documents(..., return_chunks=True)``.

    documents: (n_docs, dim) float32, row i is texts[i].
    chunks: (n_chunks, dim) float32 chunk vectors as aggregated (L2-normalised when
        ``normalize_chunks``); chunks of a document are contiguous and in document order.
    chunk_document: (n_chunks,) int64 document index of each chunk.
    chunk_start, chunk_end: (n_chunks,) int64 the chunk's content span ``[start, end)`` in its
        document's tokens (tokenized without special tokens).
    document_tokens: (n_docs,) int64 token count of every document.
    chunk_start_char, chunk_end_char: (n_chunks,) int64 the chunk's text is
        ``texts[chunk_document[c]][chunk_start_char[c]:chunk_end_char[c]]`` (no prefix or special
        token; spans tile their document in order, and overlap where ``overlap > 0``; see
        `dice_fast.chunking.chunk_char_spans`).
    """

    documents: np.ndarray
    chunks: np.ndarray
    chunk_document: np.ndarray
    chunk_start: np.ndarray
    chunk_end: np.ndarray
    document_tokens: np.ndarray
    chunk_start_char: np.ndarray
    chunk_end_char: np.ndarray

    @classmethod
    def of_plan(cls, plan: EncodingPlan, documents: np.ndarray, chunks: np.ndarray) -> DiceOutput:
        """The output of ``plan`` given its (n_docs, dim) document and (n_chunks, dim) chunk vectors
        (what a `ChunkQueue` job submitted with ``keep_chunks=True`` holds when done)."""
        start_char, end_char = plan.chunk_char_spans
        return cls(
            documents=documents,
            chunks=chunks,
            chunk_document=plan.chunks.document.copy(),
            chunk_start=plan.chunks.start.copy(),
            chunk_end=plan.chunks.start + plan.chunks.length,
            document_tokens=plan.tokens.lengths.copy(),
            chunk_start_char=start_char,
            chunk_end_char=end_char,
        )


def concat_outputs(blocks: list, dim: int, return_chunks: bool):
    """One result from per-window results (`DiceOutput` chunk_document made global; character spans
    are already in their own document's coordinates)."""
    if not return_chunks:
        return np.concatenate(blocks) if blocks else np.zeros((0, dim), np.float32)
    if len(blocks) == 1:
        return blocks[0]
    base = np.cumsum([0] + [len(b.documents) for b in blocks[:-1]])
    return DiceOutput(
        documents=np.concatenate([b.documents for b in blocks]),
        chunks=np.concatenate([b.chunks for b in blocks]),
        chunk_document=np.concatenate([b.chunk_document + o for b, o in zip(blocks, base)]),
        chunk_start=np.concatenate([b.chunk_start for b in blocks]),
        chunk_end=np.concatenate([b.chunk_end for b in blocks]),
        document_tokens=np.concatenate([b.document_tokens for b in blocks]),
        chunk_start_char=np.concatenate([b.chunk_start_char for b in blocks]),
        chunk_end_char=np.concatenate([b.chunk_end_char for b in blocks]),
    )
