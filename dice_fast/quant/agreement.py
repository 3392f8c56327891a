"""How close a lower-precision encoder comes to float32: measured on held-out real text, never assumed.

    a = agreement(int8_encoder, float32_encoder)   # Agreement(cos_min, cos_mean, n_chunks, tokens)
    a.meets(0.99)                                   # the bound a dtype="auto" choice can ask for

The text is the second half of the bundled prose (`dice_fast.data.prose_halves`), which no
calibration of the int8 path sees, cut into windows of the encoder's chunk size; every window is one
chunk, and the cosine is taken between the two encoders' chunk vectors of the same chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError, OptionError


@dataclass(frozen=True)
class Agreement:
    """Cosines of n_chunks chunk vectors against the reference: min and mean; tokens: text tokens run."""

    cos_min: float
    cos_mean: float
    n_chunks: int
    tokens: int

    def meets(self, cos_min: float) -> bool:
        """Whether every chunk's cosine against the reference is at least ``cos_min``."""
        return self.cos_min >= cos_min


def held_out_texts(tokenizer, n: int, tokens: int) -> list[str]:
    """``n`` windows of ``tokens`` tokens each of the held-out half of the bundled prose (see module)."""
    from ..data import prose_halves, token_windows

    return token_windows(tokenizer, "\n\n".join(prose_halves()[1]), n, tokens)


def cosines(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row-wise cosines of x and y, (n, d) each -> (n,) float64 (computed in float64)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return (x * y).sum(1) / np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), 1e-30)


def agreement(candidate, reference, n_chunks: int = 64, texts: list[str] | None = None) -> Agreement:
    """Cosines between ``candidate``'s and ``reference``'s chunk vectors (two `DiceEncoder` over one
    model and tokenizer with the same chunking) of ``texts`` (None: ``n_chunks`` held-out prose
    windows of the candidate's chunk size, one chunk each)."""
    if texts is None:
        texts = held_out_texts(candidate.tokenizer, n_chunks, candidate.config.chunk_size)
    if len(texts) == 0:
        raise InputError("agreement needs at least one text (texts=[] was given; None takes held-out prose)")
    a = candidate.encode_documents(texts, return_chunks=True)
    b = reference.encode_documents(texts, return_chunks=True)
    if a.chunks.shape != b.chunks.shape or not np.array_equal(a.chunk_start, b.chunk_start):
        raise OptionError("agreement needs two encoders that chunk the texts alike (same tokenizer and "
                         f"chunk options); got {a.chunks.shape[0]} and {b.chunks.shape[0]} chunks")
    cos = cosines(a.chunks, b.chunks)
    return Agreement(float(cos.min()), float(cos.mean()), int(len(cos)),
                     int((a.chunk_end - a.chunk_start).sum()))
