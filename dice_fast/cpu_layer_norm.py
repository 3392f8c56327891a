"""The CPU forward's bf16 LayerNorm: torch's own or dice_fast's AVX-512 kernel, measured per machine.

torch's CPU ``layer_norm`` runs bf16 through its AVX2 kernel; at MiniLM's width the model's 13
LayerNorms are ~7 % of the bf16 forward on an AMX Xeon. ``csrc/layer_norm_cpu.cpp``
(op ``dice_fast_C::layer_norm_bf16``) normalises a row with 16-lane AVX-512 in float32 and rounds
each output once, as torch does (agreement: max abs error against a float64 LayerNorm no larger than
torch's bf16 one plus one bf16 rounding; tests).

    kernel()                        # "native" or "torch": measured once per machine, cached
    applies(x, shape, weight, bias) # whether a call can take the kernel (bf16, last dim, contiguous)
    layer_norm(x, weight, bias, eps)

The kernel needs avx512_bf16 (a Zen 4 or later, an Intel Xeon of Cooper Lake or later); only there is
the C++ extension built for it (once per machine; on an AMX CPU the attention kernel built it
already). Then the first bf16 forward races the two on one (4096, 384) LayerNorm and caches the
winner beside the other CPU choices (``cpu_tuning.json``). ``DICE_FAST_CPU_LAYER_NORM`` = ``auto``
(default) | ``torch`` | ``native`` decides without measuring. The eager forward takes it through
`dice_fast.cpu_linear`'s mode; the compiled forward leaves LayerNorm to inductor, which fuses it with
the residual add before it.
"""

from __future__ import annotations

import math
import threading

import torch

from . import cpu_tuning as tuning

ENV = "DICE_FAST_CPU_LAYER_NORM"
KERNELS = ("torch", "native")
_MARGIN = 0.9  # the kernel must be this much faster to be chosen
_SHAPE = (4096, 384)  # the timed LayerNorm: a batch of MiniLM's hidden states
_NAME = "layer_norm/bfloat16"
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "ready": (ok, why) of the kernel here; "kernel": the decision


def ready() -> tuple[bool, str]:
    """(whether the kernel can run here, why not). Checks the CPU's flags first, so a CPU without
    avx512_bf16 never builds the C++ extension; on one with it, builds (or loads) ``dice_fast_C``."""
    with _LOCK:
        if "ready" not in _STATE:
            _STATE["ready"] = _probe()
        return _STATE["ready"]


def _probe() -> tuple[bool, str]:
    if not tuning.has_avx512_bf16():
        return False, "this CPU has no AVX-512 bf16 (avx512f, avx512bw, avx512vl, avx512_bf16)"
    from .ops import native

    return native.probe_kernel("layer_norm_bf16_supported",
                               "the extension was built without AVX-512 bf16 code (a compiler older than GCC 11 / Clang 12)")


def kernel() -> str:
    """The bf16 LayerNorm kernel here: "native" or "torch" (see the module docstring)."""
    raw = tuning.env_choice(ENV, KERNELS)
    if raw == "torch" or not ready()[0]:
        return "torch"  # an explicit "native" too: there is no kernel to run
    if raw == "native":
        return raw
    with _LOCK:
        return tuning.decided_kernel(_STATE, _NAME, KERNELS, measure)


def measure(budget_s: float = tuning.BUDGET_S) -> dict:
    """Race torch's and the kernel's bf16 LayerNorm on one `_SHAPE` input; the cache entry
    {"kernel", "ms", "threads", "load", "busy", "date"}."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*_SHAPE, generator=g).to(torch.bfloat16)
    w, b = (torch.randn(_SHAPE[1], generator=g).to(torch.bfloat16) for _ in range(2))
    return tuning.kernel_race({"torch": lambda: torch.nn.functional.layer_norm(x, _SHAPE[1:], w, b, 1e-12),
                               "native": lambda: layer_norm(x, w, b, 1e-12)}, "native", "torch", _MARGIN, budget_s)


def applies(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None, bias: torch.Tensor | None,
            eps: float = 1e-5) -> bool:
    """Whether ``F.layer_norm(x, normalized_shape, weight, bias, eps)`` can run on the kernel: x bf16 on
    the CPU and contiguous, normalised over its last dimension, weight (and bias, if any) contiguous
    vectors of that size in bf16 or float32, eps a finite number >= 0."""
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() == 0 \
            or not x.is_contiguous():
        return False
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        return False
    h = x.shape[-1]
    if tuple(normalized_shape) != (h,) or h == 0:
        return False
    return all(p is not None and p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float32)
               and p.shape == (h,) and p.is_contiguous() for p in (weight, *(() if bias is None else (bias,))))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm(x, (H,), weight, bias, eps)`` on the kernel: x (..., H) bf16 -> (..., H) bf16."""
    return torch.ops.dice_fast_C.layer_norm_bf16(x, weight, bias, float(eps))
