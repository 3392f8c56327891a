"""The chunk columns of a corpus job's Parquet output (``--chunks``): `ChunkRows`, a block of rows'
chunk vectors, character spans and token counts, sliced and joined by rows and written as list columns."""

from __future__ import annotations

import numpy as np

from ..scoring import cu_from_chunk_document


CHUNK_COLUMNS = ("chunk_embeddings", "chunk_start_char", "chunk_end_char", "chunk_tokens")


class ChunkRows:
    """The chunks of a block of rows: chunks (n_chunks, dim) float32, cu (n_rows + 1,) int64 (row r
    owns chunks cu[r]:cu[r+1]), start_char / end_char / tokens (n_chunks,) int64. Sliced by rows."""

    def __init__(self, chunks, cu, start_char, end_char, tokens):
        self.chunks, self.cu = chunks, np.asarray(cu, np.int64)
        self.start_char, self.end_char, self.tokens = start_char, end_char, tokens

    @classmethod
    def of_output(cls, out) -> ChunkRows:
        """From a `DiceOutput` (one window of ``stream_documents(..., return_chunks=True)``)."""
        cu = cu_from_chunk_document(out.chunk_document, len(out.documents))
        return cls(out.chunks, cu, out.chunk_start_char, out.chunk_end_char, out.chunk_end - out.chunk_start)

    def __getitem__(self, rows: slice) -> ChunkRows:
        r0, r1, _ = rows.indices(len(self.cu) - 1)
        c0, c1 = self.cu[r0], self.cu[r1]
        return ChunkRows(self.chunks[c0:c1], self.cu[r0 : r1 + 1] - c0, self.start_char[c0:c1],
                         self.end_char[c0:c1], self.tokens[c0:c1])

    @classmethod
    def concat(cls, parts: list[ChunkRows]) -> ChunkRows:
        base = np.cumsum([0] + [p.cu[-1] for p in parts[:-1]])
        cu = np.concatenate([[0]] + [p.cu[1:] + b for p, b in zip(parts, base)])
        chunks, start, end, tokens = (np.concatenate([getattr(p, name) for p in parts])
                                      for name in ("chunks", "start_char", "end_char", "tokens"))
        return cls(chunks, cu, start, end, tokens)

    def arrow_columns(self) -> list:
        import pyarrow as pa

        offsets = pa.array(self.cu.astype(np.int32) if self.cu[-1] < 2**31 else self.cu)
        flat = pa.array(np.ascontiguousarray(self.chunks, dtype=np.float32).reshape(-1), type=pa.float32())
        vectors = pa.FixedSizeListArray.from_arrays(flat, self.chunks.shape[1])
        lists = pa.ListArray if offsets.type == pa.int32() else pa.LargeListArray
        return [lists.from_arrays(offsets, vectors)] + [
            lists.from_arrays(offsets, pa.array(np.asarray(a, np.int64))) for a in (self.start_char, self.end_char, self.tokens)]
