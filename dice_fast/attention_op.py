"""The varlen attention as a traceable op: what the compiled forward (`dice_fast.compiled`) runs.

`dice_varlen_attention` (`dice_fast.attention`) reads its batch from a context variable, which
``torch.compile`` cannot trace (a graph break in every layer). Here the same exact block-diagonal
attention is a ``torch.library.custom_op``, ``dice_fast::sdpa_groups``, whose inputs are all
tensors and constants, with a fake (meta) implementation that gives the output's shape without
running it: the compiler keeps it as one opaque node per layer and fuses everything around it.

* ``dice_fast::sdpa_groups(q, k, v, groups, causal, scale, window)``: q (T, Hq, D), k/v (T, Hkv, D),
  groups (G, 3) int64 on the CPU, rows (token_start, n_chunks, length) of runs of equal-length chunks
  (rows with n_chunks = 0 are padding, skipped); window: a sliding window in tokens, 0 for none.
  Returns (T, Hq, D) in q's dtype, computed exactly as the eager ``sdpa_groups`` backend.
* ``dice_fast::varlen(q, k, v, cu_seqlens, max_len, causal, scale, window, backend)``: the CUDA
  kernels (``backend`` "flash_attn" or "torch_varlen", `dice_fast.attention`) behind one opaque op:
  cu_seqlens (n + 1,) int32 on the device, max_len (1,) int64 on the CPU (a tensor, so the compiled
  graph does not specialise on it), k/v unrepeated (GQA heads go to the kernel as they are where it
  takes them). Returns (T, Hq, D) in q's dtype.
* `TRACED_NAME`: the attention implementation name under which `traced_attention` and a mask
  function that never builds a mask are registered with transformers. The compiled forward runs a
  shadow of the model (`dice_fast.compiled`) whose config names it; the caller's model is not touched.

The batch reaches every layer as forward keyword arguments, as transformers passes them through:
``dice_groups`` (the groups tensor; sdpa_groups) or ``dice_max_len`` with ``cu_seq_lens_q`` and
``dice_backend`` (the CUDA varlen kernels), and ``dice_causal`` (the encoder's forced attention mode,
None for the model's own).
"""

from __future__ import annotations

import torch

from . import attention as attn
from .attention import groups_attention, layer_window, resolve_causal
from .errors import OptionError

TRACED_NAME = "dice_fast_varlen_traced"


@torch.library.custom_op("dice_fast::sdpa_groups", mutates_args=())
def sdpa_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: torch.Tensor, causal: bool,
                scale: float, window: int) -> torch.Tensor:
    """Exact block-diagonal attention of packed chunks (see the module docstring for shapes)."""
    runs = groups.tolist()
    longest = max((r[2] for r in runs if r[1]), default=0)
    band = window - 1 if window and longest > window else None
    return groups_attention(q, k, v, runs, causal, scale, band)


@sdpa_groups.register_fake
def _(q, k, v, groups, causal, scale, window):
    return q.new_empty(q.shape)


@torch.library.custom_op("dice_fast::varlen", mutates_args=())
def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: torch.Tensor,
           causal: bool, scale: float, window: int, backend: str) -> torch.Tensor:
    """Exact block-diagonal attention through a CUDA varlen kernel (see the module docstring)."""
    longest = int(max_len[0])
    band = window - 1 if window and longest > window else None
    kernel = attn.flash_varlen if backend == "flash_attn" else attn.torch_varlen
    return kernel(q, k, v, cu_seqlens, longest, causal, scale, band)


@varlen.register_fake
def _(q, k, v, cu_seqlens, max_len, causal, scale, window, backend):
    return q.new_empty(q.shape)


def max_len_tensor(max_seqlen: int) -> torch.Tensor:
    """The ``max_len`` argument of `varlen`: (1,) int64 on the CPU."""
    return torch.tensor([int(max_seqlen)], dtype=torch.int64)


def group_table(groups: tuple[tuple[int, int, int], ...], min_rows: int = 2) -> torch.Tensor:
    """(max(G, min_rows), 3) int64 tensor of a batch's runs, padded with empty runs: a batch of one
    run then has the same (symbolic) shape as any other, so the compiler does not specialise on it."""
    rows = list(groups) + [(0, 0, 0)] * max(0, min_rows - len(groups))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def traced_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Packed attention without host state. query: (1, Hq, T, D); key, value: (1, Hkv, T, D).
    Returns ((1, T, Hq, D), None). Needs the ``dice_groups`` forward argument."""
    groups, max_len = kwargs.get("dice_groups"), kwargs.get("dice_max_len")
    if groups is None and max_len is None:
        raise OptionError(f"{TRACED_NAME} attention runs only inside dice_fast's compiled forward (no dice_groups)")
    if attention_mask is not None or kwargs.get("position_bias") is not None:
        raise OptionError("the compiled packed forward cannot apply a mask or position bias of the model's own")
    causal = resolve_causal(kwargs.get("dice_causal"), module, kwargs)
    window = layer_window(module, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    if groups is not None:
        out = torch.ops.dice_fast.sdpa_groups(q, k, v, groups, causal, float(scale), int(window or 0))
    else:
        out = torch.ops.dice_fast.varlen(q, k, v, kwargs["cu_seq_lens_q"], max_len, causal, float(scale),
                                         int(window or 0), kwargs["dice_backend"])
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    """Inside the compiled packed forward attention is block-diagonal by ``dice_groups``: no mask."""
    return None


def register() -> str:
    """Register `traced_attention` and its mask function with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TRACED_NAME, traced_attention)
    AttentionMaskInterface.register(TRACED_NAME, _no_mask)
    return TRACED_NAME
