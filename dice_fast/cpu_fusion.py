"""Which of a model's linears feed only a GELU: the CPU forward runs each such pair as one oneDNN call.

In an encoder's feed-forward block (BERT's ``BertIntermediate``, and every class copied from it)
the first linear's output goes only to a GELU. Run apart, the GELU is a second pass over the block's
widest activation (tokens x 4 hidden), and its erf, not memory, is its cost: 12 % of MiniLM's bf16
forward on an AMX Xeon (benchmarks/RESULTS.md §21). oneDNN's linear applies the GELU to its float32
accumulators before the output is written (a post-op), so the pass and a bf16 rounding go away.

    gelu_linears(model)   # {id(linear.weight): "none" | "tanh"}: the linears to run with a GELU post-op

A linear qualifies only when tracing its parent module (``torch.fx``) shows exactly
``output = gelu(linear(input))``: one input, the linear, one GELU (``F.gelu`` or ``nn.GELU``, exact
or tanh), nothing else reading the linear's output, and the linear's weight held by no other
module, its module registered once, and no forward hook that could see the fused output. Anything else (a GLU, a GELU written in Python,
a dropout between) is left as it is. `dice_fast.cpu_linear`'s mode then runs the linear with the
post-op and passes the GELU that follows through unchanged; nothing in the model changes.

Agreement: the GELU is computed from the float32 accumulator instead of the bf16-rounded output,
one rounding fewer than the plain forward (MiniLM bf16 against float32: cos min 0.99992 fused,
0.99991 apart); in float32 the two differ by oneDNN's and torch's erf (~1e-7). Measured, AMX Xeon,
bf16: +4.6 % end to end; float32: unchanged (§21). ``DICE_FAST_CPU_FUSION=off`` runs every GELU apart.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .errors import OptionError

ENV = "DICE_FAST_CPU_FUSION"
APPROXIMATIONS = ("none", "tanh")  # F.gelu's, which oneDNN's GELU post-op computes ("gelu_erf", "gelu_tanh")


def enabled() -> bool:
    """Whether ``DICE_FAST_CPU_FUSION`` (``on``, the default, or ``off``) lets the CPU forward fuse."""
    raw = os.environ.get(ENV, "on").strip().lower() or "on"
    if raw not in ("on", "off"):
        raise OptionError(f"{ENV} must be on or off, got {raw!r}")
    return raw == "on"


def gelu_linears(model: nn.Module) -> dict[int, str]:
    """{id(weight): approximate} for each ``nn.Linear`` of ``model`` whose output feeds only a GELU
    (see the module docstring); empty when fusion is off."""
    if not enabled():
        return {}
    holders: dict[int, int] = {}  # id(weight) -> how many modules hold it
    seen: dict[int, int] = {}  # id(module) -> how many times it is registered
    for module in model.modules(remove_duplicate=False):
        seen[id(module)] = seen.get(id(module), 0) + 1
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    found = {}
    for parent in model.modules():
        match = _linear_then_gelu(parent)
        if match is None:
            continue
        linear, approximate = match
        if holders.get(id(linear.weight)) == 1 and seen.get(id(linear)) == 1 and not _hooked(parent):
            found[id(linear.weight)] = approximate
    return found


def _linear_then_gelu(parent: nn.Module) -> tuple[nn.Linear, str] | None:
    """(the linear, approximate) when ``parent`` computes exactly ``gelu(linear(x))``, else None."""
    children = dict(parent.named_children())
    linears = [c for c in children.values() if type(c) is nn.Linear]
    if len(linears) != 1 or any(
            next(c.parameters(), None) is not None for c in children.values() if c is not linears[0]):
        return None  # only modules of one linear plus parameter-free parts (an activation) are traced
    try:
        graph = torch.fx.symbolic_trace(parent).graph
    except Exception:  # noqa: BLE001  (any module fx cannot trace is simply not fused)
        return None
    nodes = list(graph.nodes)
    if [n.op for n in nodes] != ["placeholder", "call_module", nodes[2].op, "output"]:
        return None
    x, lin, act, out = nodes
    if parent.get_submodule(lin.target) is not linears[0] or lin.args != (x,) or lin.kwargs:
        return None
    approximate = _gelu_approximation(parent, act, lin)
    if approximate is None or out.args != (act,):
        return None
    return linears[0], approximate


def _gelu_approximation(parent: nn.Module, node, arg) -> str | None:
    """``approximate`` of the GELU that ``node`` applies to ``arg`` alone, or None if it is not one."""
    if node.op == "call_function" and node.target is F.gelu and node.args == (arg,):
        approximate = node.kwargs.get("approximate", "none")
        if set(node.kwargs) <= {"approximate"} and approximate in APPROXIMATIONS:
            return approximate
    if node.op == "call_module" and node.args == (arg,) and not node.kwargs:
        module = parent.get_submodule(node.target)
        if type(module) is nn.GELU and module.approximate in APPROXIMATIONS:
            return module.approximate
    return None


def _hooked(parent: nn.Module) -> bool:
    """Whether a forward hook or pre-hook could see the linear's output: one on ``parent`` or any module
    under it, or a global one (`nn.modules.module.register_module_forward_hook`)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in parent.modules())
