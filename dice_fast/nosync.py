"""Packed forwards without a device-to-host sync, and a counter of host syncs to prove it.

transformers (5.x) looks for packed sequences in ``position_ids`` when a model builds its attention
mask (decoders' causal masks; encoders' bidirectional ones since transformers 5.25):
``find_packed_sequence_indices`` ends in a data-dependent ``if (...).all()``, one device-to-host sync
per forward (it stalls the launch queue on a GPU, makes a CUDA-graph capture fail, and cannot run on
meta tensors). It runs only when no 2-D attention mask is given. dice_fast's packed forward gives
one, all True (`sync_free_kwargs`): transformers then hands it to dice_fast's registered mask
function, which builds no mask inside a packed forward (`dice_fast.attention`), so nothing changes
but the check that no longer runs.

`HostSyncs` counts the tensor methods that read device data on the host (``item``, ``bool``,
``int``, ``float``, ``tolist``, ``numpy``, ``nonzero``, ...) in a region, so a CPU test can assert that
a forward has none (on a GPU, ``torch.cuda.set_sync_debug_mode("error")`` says the same).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods whose result is a host value computed from the tensor's data
SYNC_METHODS = frozenset({"item", "__bool__", "__int__", "__float__", "__index__", "__len__", "tolist", "numpy",
                          "nonzero", "unique", "cpu", "equal", "allclose", "masked_select"})


def sync_free_kwargs(input_ids: torch.Tensor) -> dict:
    """Forward keyword arguments that keep transformers' packed-sequence check off device data.

    input_ids: (1, T) on the model's device. Returns ``{"attention_mask": (1, T) bool, all True}``."""
    return {"attention_mask": torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)}


class HostSyncs(TorchFunctionMode):
    """``with HostSyncs() as s: ...`` records in ``s.calls`` every `SYNC_METHODS` call made on a
    tensor inside the region (name, shape of the tensor), in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            self.calls.append((name, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))
