"""Block-diagonal (varlen) attention for packed chunks, plugged into Hugging Face models.

One function, `dice_varlen_attention`, is registered with ``transformers.AttentionInterface`` under
the name `ATTENTION_NAME`. Every model that dispatches attention through that interface (BERT,
RoBERTa/XLM-R, Llama, Mistral, Qwen2/3, ...) then runs packed: the engine passes
``cu_seq_lens_q/k`` (int32, leading 0) and ``max_length_q/k`` (host ints) as forward keyword
arguments, which transformers forwards to every attention call; nothing is inferred per layer.
The mask function registered beside it builds no mask inside a packed forward.

Backends (all exact: a chunk attends only to itself):

* ``flash_attn``: ``flash_attn_interface.flash_attn_varlen_func`` (FA3, Hopper) or
  ``flash_attn.flash_attn_varlen_func`` (FA2); CUDA, fp16/bf16.
* ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn``; CUDA, fp16/bf16, no extra package.
* ``sdpa_groups``: any device and dtype; the packer orders each batch's chunks by length, so runs
  of equal-length chunks are contiguous token ranges that one dense SDPA call handles as a batch.

Sliding-window layers (Mistral/Qwen2 windows, ModernBERT's local layers) pass ``sliding_window=W``
as transformers' flash-attention path expects it: a token sees the tokens at distance <= W - 1
(and only earlier ones when causal), the same band the model's own masks cut. Every backend applies
that band inside each chunk: flash-attn and ``varlen_attn`` through ``window_size``, ``sdpa_groups``
through a banded boolean mask per run of chunks longer than the band.

`install` points a model's config at this function once, when a `DiceEncoder` is built; nothing is
switched per call. `attention_context` sets, for the duration of one packed forward and only in the
calling thread (a context variable), which backend runs and whether attention is causal (model
default, forced causal, or forced bidirectional for LLM2Vec/Dream-style embedders). Outside such a
context the function defers to the model's original implementation, and the registered mask
function to the original mask: the model keeps computing exactly what it computed before, so the
caller and other threads can go on using it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from . import cpu_attention
from .errors import OptionError

ATTENTION_NAME = "dice_fast_varlen"
BACKENDS = ("flash_attn", "torch_varlen", "sdpa_groups")


@dataclass
class _Run:
    backend: str
    causal: bool | None  # None: the model's own behaviour
    groups: tuple[tuple[int, int, int], ...]  # (token_start, n_chunks, length) runs for sdpa_groups
    calls: int = 0  # attention calls seen in this forward (the construction-time probe reads it)
    extra_bias: bool = False  # a layer passed a mask or position bias of its own (packing would drop it)
    band_masks: dict = field(default_factory=dict)  # (length, band, causal) -> (L, L) bool, for sdpa_groups


_CURRENT: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("dice_fast_attention", default=None)


# --------------------------------------------------------------------------------------------
# backend discovery
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _flash_attn_func() -> Callable | None:
    for module in ("flash_attn_interface", "flash_attn"):
        try:
            mod = __import__(module, fromlist=["flash_attn_varlen_func"])
            return mod.flash_attn_varlen_func
        except Exception:  # ImportError, or a broken binary build
            continue
    return None


@functools.lru_cache(maxsize=None)
def _torch_varlen_func() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


def backend_available(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` can run on ``device`` in this environment (imports nothing heavy twice)."""
    if backend == "sdpa_groups":
        return True
    if device.type != "cuda":
        return False
    if backend == "flash_attn":
        return _flash_attn_func() is not None
    if backend == "torch_varlen":
        return _torch_varlen_func() is not None
    raise OptionError(f"unknown attention backend {backend!r}; allowed: {', '.join(BACKENDS)}")


def supports_sliding_window(backend: str) -> bool:
    """Whether ``backend`` can apply a sliding window inside chunks (``varlen_attn`` of torch 2.9-2.10
    has no ``window_size``: the runner sends chunks longer than the window to the padded path)."""
    if backend == "torch_varlen":
        return _torch_varlen_func() is not None and "window_size" in _torch_varlen_params()
    return backend in ("flash_attn", "sdpa_groups")


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve ``requested`` ("auto" or a name in `BACKENDS`) for ``device``/``dtype``, or raise ValueError."""
    half = dtype in (torch.float16, torch.bfloat16)
    if requested == "auto":
        for name in ("flash_attn", "torch_varlen"):
            if half and backend_available(name, device):
                return name
        return "sdpa_groups"
    if requested == "padded":  # the runner's fallback: the model's own attention
        return requested
    if requested not in BACKENDS:
        raise OptionError(f"unknown attention backend {requested!r}; allowed: 'auto', {', '.join(BACKENDS)}")
    if not backend_available(requested, device):
        how = {
            "flash_attn": "it needs a CUDA device and the flash-attn package (pip install flash-attn)",
            "torch_varlen": "it needs a CUDA device and torch.nn.attention.varlen (torch >= 2.9)",
        }[requested]
        raise OptionError(f"attention backend {requested!r} is not available on {device}: {how}")
    if not half and requested != "sdpa_groups":  # SDPA runs any dtype: the float32 default on the CPU
        raise OptionError(
            f"attention backend {requested!r} supports only float16/bfloat16, not {dtype}; "
            "use dtype='bfloat16' or attention_backend='sdpa_groups'"
        )
    return requested


_ORIGINAL = "_dice_fast_original_attn"  # config attribute: the implementation install() replaced


def register() -> str:
    """Register `dice_varlen_attention` and its mask function with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, dice_varlen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _dice_mask)
    return ATTENTION_NAME


def install(model) -> None:
    """Point ``model``'s attention at `dice_varlen_attention` (idempotent; the original is remembered)."""
    register()
    config = model.config
    if config._attn_implementation != ATTENTION_NAME:
        setattr(config, _ORIGINAL, config._attn_implementation or "eager")
        config._attn_implementation = ATTENTION_NAME


def uninstall(model) -> None:
    """Give ``model`` back its original attention implementation."""
    config = model.config
    if config._attn_implementation == ATTENTION_NAME:
        config._attn_implementation = getattr(config, _ORIGINAL, "eager")


def installed(model) -> bool:
    return model.config._attn_implementation == ATTENTION_NAME


def _original(config) -> str:
    return getattr(config, _ORIGINAL, None) or "sdpa"


def _dice_mask(*args, config=None, **kwargs):
    """No mask inside a packed forward (attention is block-diagonal by cu_seqlens); else the original's."""
    if _CURRENT.get() is not None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS[_original(config)](*args, config=config, **kwargs)


def _original_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own attention, as it ran before `install`."""
    import sys

    from transformers import AttentionInterface

    config = getattr(module, "config", None)
    name = _original(config)
    if name != "eager" and name in AttentionInterface._global_mapping:
        fn = AttentionInterface._global_mapping[name]
    else:
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"cannot find the original attention ({name!r}) of {type(module).__name__}")
    return fn(module, query, key, value, attention_mask, **kwargs)


# --------------------------------------------------------------------------------------------
# the attention function transformers calls
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def attention_context(backend: str, causal: bool | None, chunk_lengths_sorted=None, cu_seqlens_host=None):
    """Run the enclosed forward with ``backend`` and ``causal`` (None: the model's own behaviour).

    ``chunk_lengths_sorted``: the batch's chunk lengths in packing order (non-increasing), needed by
    ``sdpa_groups`` to find the runs of equal-length chunks once per batch rather than per layer.
    """
    groups: tuple = ()
    if backend == "sdpa_groups":
        groups = length_runs(chunk_lengths_sorted, cu_seqlens_host)
    run = _Run(backend, causal, groups)
    token = _CURRENT.set(run)
    try:
        yield run
    finally:
        _CURRENT.reset(token)


def length_runs(lengths, cu) -> tuple[tuple[int, int, int], ...]:
    runs = []
    i, n = 0, len(lengths)
    while i < n:
        j = i
        while j < n and lengths[j] == lengths[i]:
            j += 1
        runs.append((int(cu[i]), j - i, int(lengths[i])))
        i = j
    return tuple(runs)


def dice_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """Packed attention. query: (1, Hq, T, D); key, value: (1, Hkv, T, D). Returns ((1, T, Hq, D), None)."""
    run = _CURRENT.get()
    if run is None:  # not a packed forward of this thread: the model's own attention, unchanged
        return _original_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)
    run.calls += 1
    if attention_mask is not None or kwargs.get("position_bias") is not None:
        run.extra_bias = True
    if query.shape[0] != 1:
        raise OptionError(f"packed attention expects batch size 1, got query of shape {tuple(query.shape)}")
    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if cu is None or max_len is None:
        raise OptionError("packed attention needs cu_seq_lens_q and max_length_q forward arguments")
    causal = resolve_causal(run.causal, module, kwargs)
    window = layer_window(module, kwargs)
    # tokens further apart than `band` may not attend to each other; None: no chunk is that long
    band = int(window) - 1 if window is not None and max_len > window else None
    if band is not None and not supports_sliding_window(run.backend):
        raise OptionError(
            f"a chunk of {max_len} tokens exceeds the model's sliding attention window of {window}, which the "
            f"{run.backend} backend cannot apply; use a smaller chunk_size or attention_backend='sdpa_groups'"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # (T, Hq, D)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if run.backend == "flash_attn":
        out = flash_varlen(q, k, v, cu, max_len, causal, scale, band)
    elif run.backend == "torch_varlen":
        out = torch_varlen(q, k, v, cu, max_len, causal, scale, band)
    else:
        out = groups_attention(q, k, v, run.groups, causal, scale, band, run.band_masks)
    return out.unsqueeze(0), None


def resolve_causal(forced: bool | None, module, kwargs) -> bool:
    """Whether this layer's attention is causal: ``forced`` (the encoder's attention mode) unless
    None, else the layer's own ``is_causal`` (call argument first, then the module's attribute)."""
    if forced is not None:
        return forced
    if kwargs.get("is_causal") is not None:
        return bool(kwargs["is_causal"])
    return bool(getattr(module, "is_causal", False))


def layer_window(module, kwargs) -> int | None:
    """The layer's sliding attention window in tokens (None: full attention)."""
    return kwargs.get("sliding_window", getattr(module, "sliding_window", None))


def flash_varlen(q, k, v, cu, max_len, causal, scale, band=None):
    """flash-attn's varlen kernel. q: (T, Hq, D); k, v: (T, Hkv, D), unrepeated (it takes GQA heads)."""
    extra = {} if band is None else {"window_size": (band, band)}  # inclusive; causal drops the right side
    out = _flash_attn_func()(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=causal, **extra)
    return out[0] if isinstance(out, tuple) else out


@functools.lru_cache(maxsize=None)
def _torch_varlen_params() -> frozenset:
    return frozenset(inspect.signature(_torch_varlen_func()).parameters)


def torch_varlen(q, k, v, cu, max_len, causal, scale, band=None):
    """torch's ``varlen_attn``. q: (T, Hq, D); k, v: (T, Hkv, D), unrepeated with ``enable_gqa`` (torch
    >= 2.12) or through its flash kernel (`direct_flash_gqa`), else repeated Hq / Hkv times."""
    params = _torch_varlen_params()
    if k.shape[1] != q.shape[1] and "enable_gqa" not in params and _DIRECT_GQA[0] and q.device.type in ("cuda", "meta"):
        out = direct_flash_gqa(q, k, v, cu, max_len, causal, scale, band)
        if out is not None:
            return out
    extra = {}
    if "is_causal" in params:  # torch 2.9 - 2.10 (no sliding window: refused before this call)
        extra["is_causal"] = causal
    elif causal or band is not None:  # newer torch: a (left, right) window, (-1, 0) is causal
        left = -1 if band is None else band
        extra["window_size"] = (left, 0 if causal else band)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "scale" in params:
        extra["scale"] = scale
    elif scale != q.shape[-1] ** -0.5:  # early releases have no scale argument: fold it into q
        q = q * (scale * q.shape[-1] ** 0.5)
    return _torch_varlen_func()(q, k, v, cu, cu, max_len, max_len, **extra)


_DIRECT_GQA = [True]  # cleared for the process when the direct call fails once (it then repeats K/V)


def direct_flash_gqa(q, k, v, cu, max_len, causal, scale, band=None):
    """GQA, K/V unrepeated, where ``varlen_attn`` lacks ``enable_gqa`` (torch 2.11): its kernel
    ``aten._flash_attention_forward`` takes Hkv < Hq. None when refused: the caller repeats the heads."""
    left = -1 if band is None else band
    right = (0 if causal else -1) if band is None else (0 if causal else band)
    try:
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, causal, False, scale=scale,
            window_size_left=left, window_size_right=right)[0]
    except torch.OutOfMemoryError:
        raise
    except (TypeError, RuntimeError, NotImplementedError):
        _DIRECT_GQA[0] = False
        return None


def _band_mask(memo: dict, length: int, band: int, causal: bool, device) -> torch.Tensor:
    """(L, L) bool, True where query i may attend to key j: |i - j| <= band (and j <= i when causal);
    made once per ``memo`` (a forward's) and shape."""
    key = (length, band, causal)
    mask = memo.get(key)
    if mask is None:
        i = torch.arange(length, device=device)
        dist = i[:, None] - i[None, :]
        mask = (dist <= band) & ((dist >= 0) if causal else (dist >= -band))
        memo[key] = mask
    return mask


def groups_attention(q, k, v, groups, causal, scale, band=None, band_masks=None):
    """Exact block-diagonal attention as one dense SDPA call per run of equal-length chunks (banded
    inside chunks longer than ``band + 1`` tokens when a sliding window applies).

    q: (T, Hq, D); k, v: (T, Hkv, D); groups: (token_start, n_chunks, length) runs covering the
    chunks (a run of n = 0 is skipped). Returns (T, Hq, D) in q's dtype."""
    band_masks = {} if band_masks is None else band_masks
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    gqa = hq != hkv
    # written in place, run by run (by the kernel itself where it can): a cat of runs was ~10% of MiniLM's CPU forward
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # On the CPU the dtype and kernel are measured per machine (`dice_fast.cpu_attention`): bf16 SDPA is
    # slower than fp32 on an EPYC (a (60,12,256,32) run 116 vs 97 ms) but ~2x faster on an AMX Xeon.
    cpu = q.device.type == "cpu"
    if cpu and len(groups) > 1:
        choice = cpu_attention.cpu_attention(q.dtype, d)
        if choice.dtype != q.dtype and not choice.matmul_max_len:
            # half inputs attended in float32: cast the layer's q, k, v once, not once per run (a
            # mixed-length batch has a run per tail length; the values are the same either way)
            q, k, v = q.to(choice.dtype), k.to(choice.dtype), v.to(choice.dtype)
    for start, n, length in groups:
        if n == 0:
            continue
        end = start + n * length
        # (n*L, H, D) -> (n, H, L, D), views of the packed projections
        qs = q[start:end].reshape(n, length, hq, d).transpose(1, 2)
        ks = k[start:end].reshape(n, length, hkv, d).transpose(1, 2)
        vs = v[start:end].reshape(n, length, hkv, d).transpose(1, 2)
        mask = _band_mask(band_masks, length, band, causal, q.device) if band is not None and length > band + 1 else None
        is_causal = causal and length > 1 and mask is None
        dst = out[start:end].view(n, length, hq, d).transpose(1, 2)
        if cpu:
            o = cpu_attention.cpu_attend(qs, ks, vs, is_causal, scale, gqa, mask, out=dst)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        if o is not dst:
            dst.copy_(o)
    return out
