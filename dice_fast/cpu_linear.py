"""The CPU's GEMM for the model's linear layers: torch's own (MKL) or oneDNN's, measured per machine.

On the CPU, torch runs ``nn.Linear`` in float32 through MKL's sgemm. MKL takes a slower code path on
AMD processors: measured on a 2-core AMD EPYC Zen 5 (benchmarks/RESULTS.md §16.10), a 4096 x 384 x
1536 float32 linear runs 170 GFLOP/s through ``addmm`` and 405 GFLOP/s through oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``, the kernel inductor itself emits), and bf16 726 against 826.
So which kernel runs a linear is measured, not assumed:

    cpu_linear.kernel(torch.float32)        # -> "onednn" or "torch", measured once per machine and dtype
    with cpu_linear.linear_mode("onednn"):  # every F.linear on CPU float tensors runs through oneDNN
        model(...)

The first call for a dtype races the two kernels on one linear of the engine's size (well under a
second, `cpu_tuning.BUDGET_S`) and caches the answer beside the attention choices
(``cpu_tuning.json``, per `cpu_tuning.machine_key`). ``DICE_FAST_CPU_LINEAR`` = ``auto``
(default) | ``torch`` | ``onednn`` decides without measuring.

The mode changes no model: it intercepts ``torch.nn.functional.linear`` (what ``nn.Linear`` calls)
for the duration of a forward, in the calling thread only; linears that call ``addmm`` themselves
(GPT-2's ``Conv1D``) keep torch's kernel. Exactness: both kernels compute in the input's dtype with
float accumulation; they differ by summation order only (MiniLM's chunk vectors: max abs 2.2e-7),
inside the engine's float32 tolerance against the plain model. The same mode (one per forward, so
each torch call pays one Python dispatch) also runs a linear that feeds only a GELU with the GELU
fused in (`dice_fast.cpu_fusion`) and a bf16 model's LayerNorms on the measured kernel
(`dice_fast.cpu_layer_norm`).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import cpu_layer_norm
from . import cpu_tuning as tuning
from .config import dtype_name
from .errors import ModelError

ENV_KERNEL = "DICE_FAST_CPU_LINEAR"
KERNELS = ("torch", "onednn")
_MARGIN = 0.9  # oneDNN must be this much faster to be chosen (ties keep torch's own kernel)
_SHAPE = (4096, 384, 1536)  # tokens x in x out of the timed linear: a batch of MiniLM's FFN
_DECIDED: dict[str, str] = {}
_RUNS: dict[torch.dtype, bool] = {}  # per dtype: does oneDNN's linear run it on this CPU


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN's linear and it runs ``dtype`` on this CPU (oneDNN has no
    bf16 linear without AVX-512: on an AVX2-only Zen 3 it refuses to build one)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype not in _RUNS:
        x = torch.ones(2, 8, dtype=dtype)
        try:
            onednn_linear(x, torch.ones(8, 8, dtype=dtype), None)
            _RUNS[dtype] = True
        except RuntimeError:  # "could not create a primitive descriptor for the inner product ..."
            _RUNS[dtype] = False
    return _RUNS[dtype]


def kernel(dtype: torch.dtype) -> str:
    """The linear kernel for CPU tensors of ``dtype``: "onednn" or "torch" (see the module docstring)."""
    raw = tuning.env_choice(ENV_KERNEL, KERNELS)
    if dtype not in (torch.float32, torch.bfloat16) or not available(dtype):
        return "torch"  # an explicit "onednn" too: there is no oneDNN kernel to run
    if raw != "auto":
        return raw
    return tuning.decided_kernel(_DECIDED, f"linear/{dtype_name(dtype)}", KERNELS, lambda: measure(dtype))


def model_kernel(model) -> str:
    """`kernel` for ``model``'s parameters: its dtype's on the CPU, "torch" on any other device."""
    param = next(model.parameters())
    return kernel(param.dtype) if param.device.type == "cpu" else "torch"


def measure(dtype: torch.dtype, budget_s: float = tuning.BUDGET_S) -> dict:
    """Race torch's and oneDNN's linear on one (`_SHAPE`) linear of ``dtype``; the cache entry
    {"kernel", "ms", "threads", "load", "busy", "date"}."""
    g = torch.Generator().manual_seed(0)
    m, k, n = _SHAPE
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (n,)))
    return tuning.kernel_race({"torch": lambda: F.linear(x, w, b), "onednn": lambda: onednn_linear(x, w, b)},
                              "onednn", "torch", _MARGIN, budget_s)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  gelu: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN: x (..., in), weight (out, in), bias (out,) or None;
    ``gelu`` ("none" / "tanh": F.gelu's ``approximate``) applies a GELU to the float32 accumulators
    before the output is written (oneDNN's post-op; `dice_fast.cpu_fusion`)."""
    post, algorithm = ("gelu", gelu) if gelu is not None else ("none", "")
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, post, [], algorithm)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class _CpuForward(TorchFunctionMode):
    """The forward's CPU kernels: ``F.linear`` through ``linear`` (None: torch's); a linear in ``gelu``
    ({id(weight): (weight, approximate)}, `dice_fast.cpu_fusion.active`) with the GELU that follows it
    fused, and that GELU's own call then handed its input back; ``F.layer_norm`` through ``layer_norm``
    (None: torch's) where `cpu_layer_norm.applies`."""

    def __init__(self, linear, gelu: dict, layer_norm):
        super().__init__()
        self.linear, self.gelu, self.layer_norm = linear, gelu, layer_norm
        self._activated = None  # (output of the last fused linear, its approximate) until its GELU runs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._activated is not None:  # the fused linear's output: only its GELU may read it
            y, approximate = self._activated
            self._activated = None
            if (func is F.gelu and len(args) == 1 and args[0] is y and set(kwargs) <= {"approximate"}
                    and kwargs.get("approximate", "none") == approximate):
                return y
            raise ModelError(_unfused_read(repr(func)))
        if func is F.linear and self.linear is not None:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.device.type == "cpu" and x.dtype == weight.dtype in (torch.float32, torch.bfloat16)
                    and weight.dim() == 2 and _plain_bias(bias, weight)):
                fused = self.gelu.get(id(weight))
                if fused is None or fused[0] is not weight:
                    return self.linear(x, weight, bias)
                y = self.linear(x, weight, bias, fused[1])
                self._activated = (y, fused[1])
                return y
        elif func is F.layer_norm and self.layer_norm is not None:
            names = ("input", "normalized_shape", "weight", "bias", "eps")
            call = {**dict(zip(names, args)), **kwargs}
            x, shape, weight, bias, eps = (call.get(n) for n in names)
            eps = 1e-5 if eps is None else eps
            if cpu_layer_norm.applies(x, shape, weight, bias, eps):
                return self.layer_norm(x, weight, bias, eps)
        return func(*args, **kwargs)

    def __exit__(self, exc_type, exc_value, traceback):
        pending, self._activated = self._activated, None
        super().__exit__(exc_type, exc_value, traceback)
        if pending is not None and exc_type is None:  # the fused output left the forward without its GELU
            raise ModelError(_unfused_read("the forward's caller"))


def _unfused_read(reader: str) -> str:
    return (f"dice_fast fused a linear with the GELU after it (dice_fast.cpu_fusion), but {reader} read the "
            "linear's output first; set DICE_FAST_CPU_FUSION=off to run this model (and report it)")


def _plain_bias(bias, weight) -> bool:
    """Whether oneDNN can take ``bias`` as it is: None, or a contiguous (out,) vector of the weight's
    dtype (it reads the buffer flat: a strided or broadcast bias goes to torch's kernel)."""
    return bias is None or (bias.dtype == weight.dtype and bias.dim() == 1 and bias.shape[0] == weight.shape[0]
                            and bias.is_contiguous())


_TRACED = []
_LOCK = threading.Lock()


def traced_linear():
    """`onednn_linear` as the opaque op ``dice_fast::onednn_linear`` (registered at first use, never at
    import): inductor cannot lower oneDNN's linear on an unpacked weight, so the compiled forward
    (`dice_fast.compiled`) keeps it as one extern call per linear and fuses the work around it."""
    with _LOCK:
        if not _TRACED:
            @torch.library.custom_op("dice_fast::onednn_linear", mutates_args=())
            def op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   gelu: str | None = None) -> torch.Tensor:
                return onednn_linear(x, weight, bias, gelu)

            @op.register_fake
            def _(x, weight, bias, gelu=None):
                return x.new_empty((*x.shape[:-1], weight.shape[0]))

            _TRACED.append(op)
    return _TRACED[0]


def linear_mode(name: str, linear=None, gelu: dict | None = None, layer_norm=None):
    """A context in which ``F.linear`` runs through kernel ``name`` ("onednn"; "torch": torch's own):
    ``linear`` (default `onednn_linear`; a compiled forward passes `traced_linear()`, made outside the
    traced code); ``gelu`` the linears to fuse with the GELU after them (`dice_fast.cpu_fusion.active`,
    oneDNN only); ``layer_norm`` a bf16 LayerNorm to run where it applies (`dice_fast.cpu_layer_norm`).
    Nothing is entered when nothing changes."""
    if name != "onednn" and layer_norm is None:
        return contextlib.nullcontext()
    onednn = name == "onednn"
    return _CpuForward((linear or onednn_linear) if onednn else None, (gelu or {}) if onednn else {}, layer_norm)
