"""Random inputs shared by the pooling-op tests (Triton, C++ and vectorised PyTorch)."""

from __future__ import annotations

import torch


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cu(lengths, dtype=torch.int32, device="cpu") -> torch.Tensor:
    """(n + 1,) cumulative offsets of ``lengths`` with a leading 0."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.as_tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return out.to(dtype).to(device)


def hidden(total: int, H: int, dtype, seed: int, device="cpu") -> torch.Tensor:
    """(total, H) token states; mean offset so pooled vectors are not ~0 (relative errors stay meaningful)."""
    return (torch.randn(total, H, generator=gen(seed)) + 0.5).to(dtype).to(device)


def lengths(n: int, hi: int, seed: int, extra=()) -> list[int]:
    """``extra`` then ``n`` random segment lengths in [1, hi]."""
    return list(extra) + torch.randint(1, hi + 1, (n,), generator=gen(seed)).tolist()
