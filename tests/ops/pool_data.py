"""Random inputs shared by the pooling-op tests (Triton, C++ and vectorised PyTorch).

Every helper takes ``device``; left out, it is `DEFAULT_DEVICE` ("cpu"). A CPU rehearsal of a GPU
test sets `DEFAULT_DEVICE` to "meta" (`forgotten_device_is_meta`), so a tensor built without naming
the test's device lands on meta and the kernels' input checks fail here, as they would on the GPU.
"""

from __future__ import annotations

import contextlib

import torch

DEFAULT_DEVICE = "cpu"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cu(lengths, dtype=torch.int32, device=None) -> torch.Tensor:
    """(n + 1,) cumulative offsets of ``lengths`` with a leading 0."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.as_tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return out.to(dtype).to(device or DEFAULT_DEVICE)


def hidden(total: int, H: int, dtype, seed: int, device=None) -> torch.Tensor:
    """(total, H) token states; mean offset so pooled vectors are not ~0 (relative errors stay meaningful)."""
    return (torch.randn(total, H, generator=gen(seed)) + 0.5).to(dtype).to(device or DEFAULT_DEVICE)


def lengths(n: int, hi: int, seed: int, extra=()) -> list[int]:
    """``extra`` then ``n`` random segment lengths in [1, hi]."""
    return list(extra) + torch.randint(1, hi + 1, (n,), generator=gen(seed)).tolist()


@contextlib.contextmanager
def forgotten_device_is_meta():
    """Within: helpers called without ``device`` build meta tensors (see the module docstring)."""
    global DEFAULT_DEVICE
    old, DEFAULT_DEVICE = DEFAULT_DEVICE, "meta"
    try:
        yield
    finally:
        DEFAULT_DEVICE = old
