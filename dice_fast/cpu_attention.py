"""CPU attention, run the way the machine that runs it measured fastest.

CPU attention of half-precision inputs (the bf16 engine on a CPU) can run in the input dtype or
in float32, through SDPA or, for short runs of equal-length chunks, a plain batched matmul. Which
is fastest depends on the CPU: a 2-core AMD EPYC with avx512_bf16 runs SDPA faster in float32; an
Intel Xeon with AMX runs bf16 SDPA about 2x faster than float32; an EPYC without any bf16
instructions (AVX2 only) runs bf16 matmuls emulated, far slower than float32. So the choice is measured,
not hard-coded:

    cpu_attention.cpu_attention(torch.bfloat16, head_dim=64)   # -> CpuAttention(dtype, matmul_max_len, source)
    cpu_attention.cpu_attend(q, k, v, causal, scale, enable_gqa) # one run, attended the chosen way

The first call for a (dtype, head size) runs a micro-benchmark (well under a second, bounded by
`BUDGET_S`) of the kernels the engine runs, on the engine's own layout (strided views of packed
projections), casts included; the answer is kept for the process and cached per machine in the
CPU tuning cache (`dice_fast.cpu_tuning`: ``cpu_tuning.json`` under ``$DICE_FAST_CACHE_DIR``).
Nothing runs at import.

Environment overrides (no benchmark is run when they decide):

* ``DICE_FAST_CPU_ATTENTION_DTYPE`` = ``auto`` (default, measured) | ``float32`` (half inputs are
  attended in float32) | ``input`` (attended in their own dtype; ``bfloat16`` / ``float16`` are
  accepted as aliases). Float32 inputs are always attended in float32.
* ``DICE_FAST_CPU_ATTENTION_KERNEL`` = ``auto`` (measured) | ``sdpa`` (never the matmul kernel).

Exactness: float32 attention is at least as exact as the plain model's; attention in bf16 is what
the plain Hugging Face model itself does in bf16 (SDPA accumulates in float32), so both stay within
the engine's bf16 tolerance. The matmul kernel always computes in float32.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cpu_tuning import BUDGET_S, busy, cached_entry, measured_load, race
from .errors import OptionError

ENV_DTYPE = "DICE_FAST_CPU_ATTENTION_DTYPE"
ENV_KERNEL = "DICE_FAST_CPU_ATTENTION_KERNEL"
# lower precision must win by this margin to be chosen (ties keep float32: more exact)
_MARGIN = 0.9
# lengths at which the matmul kernel is tried against SDPA; the largest that wins is kept
_MATMUL_LENGTHS = (16, 64)
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CpuAttention:
    """How CPU attention of one input dtype runs.

    dtype: what SDPA computes in; matmul_max_len: runs of chunks no longer than this use the float32
    batched-matmul kernel (0: never); source: "measured", "cache" or "env".
    """

    dtype: torch.dtype
    matmul_max_len: int
    source: str


_LOCK = threading.Lock()
_MEMO: dict[tuple, CpuAttention] = {}


def reset() -> None:
    """Forget this process's decisions (the on-disk cache stays)."""
    with _LOCK:
        _MEMO.clear()


def decisions() -> dict[str, CpuAttention]:
    """The CPU attention choices this process has made so far, by ``"<dtype>/d<head size>"``
    (empty until CPU attention has run: a benchmark can name what actually ran)."""
    return {f"{_dtype_name(k[0])}/d{k[1]}": v for k, v in list(_MEMO.items())}


def describe(dtype: torch.dtype) -> str:
    """A short label of how CPU attention of ``dtype`` inputs ran in this process ("" when it has not):
    the compute dtype, plus ``mm<=L`` when short runs used the matmul kernel, e.g. ``"bf16"``, ``"fp32 mm<=16"``."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    found = sorted({(short.get(c.dtype, str(c.dtype)), c.matmul_max_len) for k, c in list(_MEMO.items()) if k[0] == dtype})
    return ", ".join(d + (f" mm<={m}" if m else "") for d, m in found)


# --------------------------------------------------------------------------------------------
# what the engine calls
# --------------------------------------------------------------------------------------------
def cpu_attention_dtype(dtype: torch.dtype, head_dim: int = 64) -> torch.dtype:
    """The dtype CPU SDPA computes in for inputs of ``dtype`` (see `cpu_attention`)."""
    return cpu_attention(dtype, head_dim).dtype


def cpu_attention(dtype: torch.dtype, head_dim: int = 64) -> CpuAttention:
    """The CPU attention choice for inputs of ``dtype`` with heads of ``head_dim``: from the
    environment, this process's memo, the machine's cache file, or a micro-benchmark (in that order)."""
    if dtype not in (*_HALF, torch.float32):
        return CpuAttention(dtype, 0, "unsupported dtype: SDPA as is")
    key = (dtype, _bucket(head_dim), os.environ.get(ENV_DTYPE, ""), os.environ.get(ENV_KERNEL, ""))
    got = _MEMO.get(key)
    if got is not None:
        return got
    with _LOCK:
        if key not in _MEMO:
            _MEMO[key] = _decide(dtype, _bucket(head_dim))
        return _MEMO[key]


def cpu_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               enable_gqa: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one run of equal-length chunks on the CPU, the way this machine does it fastest.

    q: (n, Hq, L, D); k, v: (n, Hkv, L, D), any strides, same dtype; mask: None or (L, L) bool, True
    where attention is allowed (a sliding-window band; ``causal`` is then False). Returns
    (n, Hq, L, D) in the dtype it was computed in (the caller copies it into its output, rounding once).
    """
    choice = cpu_attention(q.dtype, q.shape[-1])
    if mask is None and q.shape[2] <= choice.matmul_max_len:
        return matmul_attention(q.float(), k.float(), v.float(), causal, scale)
    work = choice.dtype
    return F.scaled_dot_product_attention(q.to(work), k.to(work), v.to(work), attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=enable_gqa)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Plain batched-matmul attention (scores materialised): fast for short runs on some CPUs.

    q: (n, Hq, L, D); k, v: (n, Hkv, L, D) with Hq a multiple of Hkv (GQA by broadcasting, no copy).
    Returns (n, Hq, L, D) in q's dtype.
    """
    n, hq, length, d = q.shape
    hkv = k.shape[1]
    qg = q.unflatten(1, (hkv, hq // hkv))
    scores = torch.matmul(qg * scale, k.unsqueeze(2).transpose(-1, -2))  # (n, hkv, rep, L, L)
    if causal:
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.unsqueeze(2)).reshape(n, hq, length, d)


# --------------------------------------------------------------------------------------------
# deciding
# --------------------------------------------------------------------------------------------
def _bucket(head_dim: int) -> int:
    return min(256, max(16, 1 << max(0, int(head_dim) - 1).bit_length()))


def _env_dtype(dtype: torch.dtype) -> torch.dtype | None:
    raw = os.environ.get(ENV_DTYPE, "auto").strip().lower() or "auto"
    if raw == "auto":
        return None
    if raw in ("float32", "fp32"):
        return torch.float32
    if raw in ("input", "native", "bfloat16", "bf16", "float16", "fp16", "half"):
        return dtype
    raise OptionError(f"{ENV_DTYPE} must be auto, float32 or input (bfloat16 / float16), got {raw!r}")


def _env_sdpa_only() -> bool:
    raw = os.environ.get(ENV_KERNEL, "auto").strip().lower() or "auto"
    if raw not in ("auto", "sdpa"):
        raise OptionError(f"{ENV_KERNEL} must be auto or sdpa, got {raw!r}")
    return raw == "sdpa"


def _decide(dtype: torch.dtype, head_dim: int) -> CpuAttention:
    env = _env_dtype(dtype)  # read for float32 inputs too, so a bad value is refused whatever the dtype
    forced = torch.float32 if dtype == torch.float32 else env
    kernel_forced = _env_sdpa_only()
    if forced is not None and kernel_forced:
        return CpuAttention(forced, 0, "env")
    entry, source = cached_entry(f"{_dtype_name(dtype)}/d{head_dim}", _valid,
                                 lambda: measure_cpu_attention(dtype, head_dim))
    work = forced if forced is not None else getattr(torch, entry["dtype"])
    matmul = 0 if kernel_forced else int(entry["matmul_max_len"])
    return CpuAttention(work, matmul, "env" if forced is not None and dtype != torch.float32 else source)


def _valid(entry) -> bool:
    return (isinstance(entry, dict) and entry.get("dtype") in ("float32", "bfloat16", "float16")
            and isinstance(entry.get("matmul_max_len"), int))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def measure_cpu_attention(dtype: torch.dtype, head_dim: int = 64, budget_s: float = BUDGET_S) -> dict:
    """Time the CPU attention candidates for ``dtype`` inputs; returns the cache entry:
    {"dtype": winner's name, "matmul_max_len": int, "ms": {case: milliseconds}, "date": ...}.

    Cases (12 heads of ``head_dim``, inputs as strided views of packed (tokens, heads, dim)
    projections, output copied back into a packed buffer of ``dtype`` as the engine does):
    ``long``: 2 chunks of 256 tokens, SDPA in float32 (inputs cast) vs in ``dtype`` (half inputs only);
    ``short<L>``: 16 chunks of L tokens, SDPA in the winner's dtype vs the float32 matmul kernel.
    Each candidate is timed best-of-k, interleaved, within ``budget_s`` (`cpu_tuning.race`: a
    candidate that stays over 8x the fastest on its first timed calls is dropped, as bf16 matmuls
    without bf16 instructions are). ``busy`` is set when the load average says other processes competed for the cores (the entry is then
    not cached: a contended timing should not decide for good).
    """
    g = torch.Generator().manual_seed(0)
    heads = 12

    def packed(n, length):
        t = [torch.randn(n * length, heads, head_dim, generator=g).to(dtype) for _ in range(3)]
        views = [x.view(n, length, heads, head_dim).transpose(1, 2) for x in t]
        out = torch.empty(n * length, heads, head_dim, dtype=dtype)
        return views, out.view(n, length, heads, head_dim)

    def sdpa_in(work, case):
        (q, k, v), out = case

        def run():
            o = F.scaled_dot_product_attention(q.to(work), k.to(work), v.to(work), scale=head_dim**-0.5)
            out.copy_(o.transpose(1, 2))
        return run

    def mm(case):
        (q, k, v), out = case

        def run():
            o = matmul_attention(q.float(), k.float(), v.float(), False, head_dim**-0.5)
            out.copy_(o.transpose(1, 2))
        return run

    deadline = time.perf_counter() + budget_s
    work, ms = torch.float32, {}
    if dtype != torch.float32:
        long_case = packed(2, 256)
        low = f"long_{_dtype_name(dtype)}"
        ms = race({"long_float32": sdpa_in(torch.float32, long_case), low: sdpa_in(dtype, long_case)},
                   deadline - budget_s / 2)
        work = dtype if ms[low] < _MARGIN * ms["long_float32"] else torch.float32
    matmul_max_len = 0
    for length in _MATMUL_LENGTHS:
        if time.perf_counter() > deadline:
            break
        case = packed(16, length)
        got = race({f"short{length}_sdpa": sdpa_in(work, case), f"short{length}_matmul": mm(case)}, deadline)
        ms.update(got)
        if got.get(f"short{length}_matmul", float("inf")) < _MARGIN * got.get(f"short{length}_sdpa", float("inf")):
            matmul_max_len = length
        else:
            break
    load = measured_load()
    return {"dtype": _dtype_name(work), "matmul_max_len": matmul_max_len, "ms": {k: round(v, 4) for k, v in ms.items()},
            "threads": torch.get_num_threads(), "load": load, "busy": busy(load),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
