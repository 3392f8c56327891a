"""Array arguments of the evaluation functions: numpy or torch in, checked numpy out, errors naming the argument."""

from __future__ import annotations

import numpy as np


def to_numpy(x, what: str) -> np.ndarray:
    """``x`` (numpy array, torch tensor on any device, or nested lists) as a numpy array; bfloat16 becomes float32."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    try:
        return np.asarray(x)
    except Exception as exc:  # pragma: no cover - exotic inputs
        raise ValueError(f"{what} cannot be converted to an array: {exc}") from None


def as_int_1d(x, what: str, n: int | None = None) -> np.ndarray:
    """``x`` as (n,) int64 (any length when ``n`` is None); ValueError naming ``what`` for a wrong
    shape or a non-integer dtype."""
    arr = to_numpy(x, what)
    if n is None:
        if arr.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    elif arr.shape != (n,):
        raise ValueError(f"{what} must have shape ({n},), got {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)
