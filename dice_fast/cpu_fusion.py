"""Which of a model's linears feed only a GELU: the CPU forward runs each such pair as one oneDNN call.

In an encoder's feed-forward block (BERT's ``BertIntermediate``, and every class copied from it)
the first linear's output goes only to a GELU. Run apart, the GELU is a second pass over the block's
widest activation (tokens x 4 hidden), and its erf, not memory, is its cost: 12 % of MiniLM's bf16
forward on an AMX Xeon (benchmarks/RESULTS.md §21). oneDNN's linear applies the GELU to its float32
accumulators before the output is written (a post-op), so the pass and a bf16 rounding go away.

    pairs = gelu_pairs(model)   # found once per encoder (GeluPair: parent, weight, approximate)
    active(pairs)               # per forward: {id(weight): (weight, approximate)} to run with a GELU post-op

A linear qualifies only when running its parent module once on a small zero input (under a recording
``TorchFunctionMode``, in the calling thread) shows exactly ``output = gelu(linear(input))``: the
linear, then one GELU (``F.gelu`` or ``nn.GELU``, exact or tanh) of its output, and no other torch
call. Its weight must be held by no other module and its module registered once. A forward hook on
the parent or anything under it, or a global one, keeps the pair apart (checked again at every
forward). Anything else (a GLU, a GELU written in Python, a dropout between) is left as it is.
`dice_fast.cpu_linear`'s mode then runs the linear with the post-op and hands the GELU call that must
follow its input back; if anything else reads the fused output first (a module called from outside
its parent, the weight used by a functional call, the output leaving the forward), the mode raises a
``ModelError`` instead of returning wrong vectors. (A parent that keeps the linear's output in a Python
attribute, with no torch call, would keep the activated tensor: no such module is known.) Nothing in the
model changes; the search runs only parents with no state of their own.

Agreement: the GELU is computed from the float32 accumulator instead of the bf16-rounded output,
one rounding fewer than the plain forward (MiniLM bf16 against float32: cos min 0.99992 fused,
0.99991 apart); in float32 the post-op equalled linear + ``F.gelu`` bit for bit on a test shape.
Measured, AMX Xeon, 500 chunks: bf16 eager +5.9 %, compiled bf16 +19 %; float32 unchanged (§21). On a
Zen 2 (AVX2) oneDNN's GELU post-op is slower than the GELU apart (one FFN linear + GELU: 49.5 ms fused,
41.3 apart; the bundled model end to end -6 %, §32), so whether to fuse is raced per machine and dtype
(`fuses`), as the linear kernel is. ``DICE_FAST_CPU_FUSION`` = ``auto`` (default) | ``on`` | ``off``
decides without measuring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from . import cpu_tuning as tuning
from .config import dtype_name

ENV = "DICE_FAST_CPU_FUSION"
MODES = ("on", "off")  # besides "auto"
SHAPE = (4096, 384, 1536)  # tokens x in x out of the raced linear + GELU: a batch of MiniLM's FFN
MARGIN = 0.97  # fused must be this much faster than apart to be chosen
_DECIDED: dict[str, str] = {}
APPROXIMATIONS = ("none", "tanh")  # F.gelu's, which oneDNN's GELU post-op computes ("gelu_erf", "gelu_tanh")


def fuses(dtype: torch.dtype) -> bool:
    """Whether linears of ``dtype`` run with their GELU fused on this CPU: ``DICE_FAST_CPU_FUSION`` on or off,
    else (auto) the faster of the two in a race on one `SHAPE` linear + GELU through oneDNN, run once per
    machine and dtype and cached beside the linear kernel's choice (`dice_fast.cpu_tuning`)."""
    raw = tuning.env_choice(ENV, MODES)
    if raw != "auto":
        return raw == "on"
    name = f"fusion/{dtype_name(dtype)}"
    return tuning.decided_kernel(_DECIDED, name, ("fused", "apart"), lambda: measure(dtype)) == "fused"


def measure(dtype: torch.dtype, budget_s: float = tuning.BUDGET_S) -> dict:
    """Race oneDNN's linear then ``F.gelu`` ("apart") against the linear with its GELU post-op ("fused") on
    one `SHAPE` linear of ``dtype``; the cache entry {"kernel", "ms", "threads", "load", "busy", "date"}."""
    from .cpu_linear import onednn_linear

    g = torch.Generator().manual_seed(0)
    m, k, n = SHAPE
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (n,)))
    return tuning.kernel_race({"apart": lambda: F.gelu(onednn_linear(x, w, b)),
                               "fused": lambda: onednn_linear(x, w, b, "none")}, "fused", "apart", MARGIN, budget_s)


@dataclass(frozen=True, eq=False)
class GeluPair:
    """A linear whose output feeds only a GELU: its ``parent`` module, the linear's ``weight`` (the tensor
    object `dice_fast.cpu_linear`'s mode recognises) and the GELU's ``approximate``."""
    parent: nn.Module
    weight: torch.Tensor
    approximate: str


def gelu_pairs(model: nn.Module) -> tuple[GeluPair, ...]:
    """Each ``nn.Linear`` of ``model`` whose output feeds only a GELU (see the module docstring); empty
    where fusing does not pay for the model's dtype (`fuses`). Found by running each candidate parent once
    on a small zero input in the calling thread (nothing global is patched: other threads may run models
    meanwhile)."""
    param = next(model.parameters(), None)
    if param is None or not fuses(param.dtype):
        return ()
    holders: dict[int, int] = {}  # id(weight) -> how many modules hold it
    seen: dict[int, int] = {}  # id(module) -> how many times it is registered
    for _, module in model.named_modules(remove_duplicate=False):  # modules() takes no remove_duplicate before torch 2.11
        seen[id(module)] = seen.get(id(module), 0) + 1
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    found = []
    for parent in model.modules():
        match = None if _hooked(parent) else _linear_then_gelu(parent)  # a hooked module is never run here
        if match is None:
            continue
        linear, approximate = match
        if holders.get(id(linear.weight)) == 1 and seen.get(id(linear)) == 1:
            found.append(GeluPair(parent, linear.weight, approximate))
    return tuple(found)


def active(pairs: tuple[GeluPair, ...]) -> dict[int, tuple[torch.Tensor, str]]:
    """{id(weight): (weight, approximate)} of the ``pairs`` one forward may fuse: those whose parent has no
    forward hook now (checked per forward: a hook registered after the pairs were found keeps its pair
    apart), none at all while a global forward hook is registered."""
    if not pairs:
        return {}
    return {id(p.weight): (p.weight, p.approximate) for p in pairs if not _hooked(p.parent)}


class _Recorder(TorchFunctionMode):
    """Records every torch function a forward calls: (func, args, kwargs, result)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def _linear_then_gelu(parent: nn.Module) -> tuple[nn.Linear, str] | None:
    """(the linear, approximate) when ``parent`` computes exactly ``gelu(linear(x))``, else None."""
    children = list(parent.children())
    linears = [c for c in children if type(c) is nn.Linear]
    others = [c for c in children if c is not linears[0]] if len(linears) == 1 else []
    if len(linears) != 1 or any(next(m.parameters(recurse=m is not parent), None) is not None
                                or next(m.buffers(recurse=m is not parent), None) is not None for m in (parent, *others)):
        return None  # only modules of one linear plus state-free parts (an activation) are run: no side effects
    linear = linears[0]
    x = torch.zeros(1, 2, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
    recorder = _Recorder()
    try:
        with torch.no_grad(), recorder:
            out = parent(x)
    except Exception:  # noqa: BLE001  (a module that needs other inputs is simply not fused)
        return None
    if len(recorder.calls) != 2:
        return None
    (lin, lin_args, lin_kwargs, y), (act, act_args, act_kwargs, g) = recorder.calls
    if (lin is not F.linear or lin_kwargs or len(lin_args) != 3 or lin_args[0] is not x
            or lin_args[1] is not linear.weight or lin_args[2] is not linear.bias):
        return None
    approximate = act_kwargs.get("approximate", "none")
    if (act is not F.gelu or len(act_args) != 1 or act_args[0] is not y or set(act_kwargs) - {"approximate"}
            or approximate not in APPROXIMATIONS or out is not g):
        return None
    return linear, approximate


def _hooked(parent: nn.Module) -> bool:
    """Whether a hook could see the linear's output: a forward or backward hook (or pre-hook) on ``parent``
    or any module under it, or a global one. nn.Module leaves its fast path for any of them, and a
    backward hook's set-up reads the output's ``requires_grad``."""
    from torch.nn.modules import module as tm

    if (tm._global_forward_hooks or tm._global_forward_pre_hooks or tm._global_backward_hooks
            or tm._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in parent.modules())
