"""Matryoshka truncation: keep the first ``d`` components of every vector, re-normalised when the vectors
are normalised. One definition for every front door: the engine's ``truncate_dim`` option, the server's
``dimensions`` request field, the corpus job's ``--truncate-dim`` and the integrations.

    truncate(vectors, 64, normalize=True)    # (n, width) -> (n, 64), rows of unit length again

Truncating a unit vector shortens it; re-normalising makes dot products cosines again, as OpenAI's
``dimensions`` and sentence-transformers' ``normalize_embeddings`` do. Meaningful for models trained
with Matryoshka representation learning; for others the leading components are just a projection.
"""

from __future__ import annotations

import numpy as np
from .errors import OptionError


def check_dim(value, width: int, name: str = "truncate_dim") -> int | None:
    """``value`` (None, or an integer in [1, width]) unchanged; ValueError naming ``name`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= width:
        raise OptionError(f"{name} must be an integer from 1 to {width} (the model's width), got {value!r}")
    return int(value)


def truncate(vectors, dim: int | None, normalize: bool):
    """vectors: (n, width) float32 numpy array or torch tensor -> (n, dim) of the same kind: the first
    ``dim`` columns, each row divided by ``max(norm, 1e-12)`` when ``normalize``. ``dim`` None or equal
    to the width returns ``vectors`` itself (already normalised, or not to be)."""
    if dim is None or dim == vectors.shape[1]:
        return vectors
    if isinstance(vectors, np.ndarray):
        out = np.array(vectors[:, :dim], dtype=np.float32, order="C")  # a copy: never scale the caller's rows
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), np.float32(1e-12))
        return out
    import torch

    out = vectors[:, :dim].contiguous()
    return torch.nn.functional.normalize(out, dim=1, eps=1e-12) if normalize else out
