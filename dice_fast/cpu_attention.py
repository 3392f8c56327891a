"""CPU attention, run the way the machine that runs it measured fastest.

CPU attention of half-precision inputs (the bf16 engine on a CPU) can run in the input dtype or
in float32, through SDPA or, for short runs of equal-length chunks, a plain batched matmul; bf16 on
a CPU with AMX also through dice_fast's own AMX kernel (``csrc/attention_cpu_amx.cpp``: K and V
packed once per head into tile layout, scores and softmax per block of 32 query rows (16 at head size
64) in L1; 1.4-1.55x torch's bf16 SDPA on a (16, 12, 256, 32) run of the AMX Xeon, RESULTS §20). Which
is fastest depends on the CPU: a 2-core AMD EPYC with avx512_bf16 runs SDPA faster in float32; an
Intel Xeon with AMX runs bf16 SDPA about 2x faster than float32; an EPYC without any bf16
instructions (AVX2 only) runs bf16 matmuls emulated, far slower than float32. So the choice is measured,
not hard-coded:

    cpu_attention.cpu_attention(torch.bfloat16, head_dim=64)   # -> CpuAttention(dtype, matmul_max_len, source, kernel)
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
* ``DICE_FAST_CPU_ATTENTION_KERNEL`` = ``auto`` (measured) | ``sdpa`` (never the matmul or AMX
  kernel) | ``amx`` (bf16 runs the AMX kernel wherever it applies; refused where the CPU has no AMX
  or the C++ extension cannot be built).

The AMX kernel lives in the ``dice_fast_C`` extension (`dice_fast.ops.native`), built on first need
(~11 s with ninja, cached on disk) only on CPUs that have AMX bf16; it attends runs of chunks up to
1,024 tokens with head size 32 or 64, no mask, not causal, no GQA (anything else goes to SDPA).

Exactness: float32 attention is at least as exact as the plain model's; attention in bf16 is what
the plain Hugging Face model itself does in bf16 (SDPA accumulates in float32), so both stay within
the engine's bf16 tolerance. The matmul kernel always computes in float32. The AMX kernel computes
as torch's bf16 flash kernel does (float32 scores and softmax, P rounded to bf16, float32
accumulation, one rounding of the output); tests/test_cpu_attention_amx.py holds it to float32 SDPA.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import dtype_name
from .cpu_tuning import BUDGET_S, cached_entry, decision_entry, env_choice, has_amx_bf16, overrides, race
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
    batched-matmul kernel (0: never); source: "measured", "cache" or "env"; kernel: "sdpa", or "amx"
    (bf16 runs the AMX kernel where it applies, `amx_applies`).
    """

    dtype: torch.dtype
    matmul_max_len: int
    source: str
    kernel: str = "sdpa"


_LOCK = threading.Lock()
_LOCK_AMX = threading.Lock()
_MEMO: dict[tuple, CpuAttention] = {}


def reset() -> None:
    """Forget this process's decisions (the on-disk cache stays)."""
    with _LOCK:
        _MEMO.clear()


def decisions() -> dict[str, CpuAttention]:
    """The CPU attention choices this process has made so far, by ``"<dtype>/d<head size>"``
    (empty until CPU attention has run: a benchmark can name what actually ran)."""
    return {f"{dtype_name(k[0])}/d{k[1]}": v for k, v in list(_MEMO.items())}


def describe(dtype: torch.dtype) -> str:
    """A short label of how CPU attention of ``dtype`` inputs ran in this process ("" when it has not):
    the compute dtype, plus ``mm<=L`` when short runs used the matmul kernel and ``amx`` when bf16 ran
    the AMX kernel, e.g. ``"bf16"``, ``"fp32 mm<=16"``, ``"bf16 amx"``."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    found = sorted({(short.get(c.dtype, str(c.dtype)), c.matmul_max_len, c.kernel)
                    for k, c in list(_MEMO.items()) if k[0] == dtype})
    return ", ".join(d + (f" mm<={m}" if m else "") + (" amx" if kern == "amx" else "") for d, m, kern in found)


def label(dtype: torch.dtype) -> str:
    """`describe` as the encoder's repr shows it: ``", cpu_attention=bf16 amx"``, or "" before any ran."""
    ran = describe(dtype)
    return f", cpu_attention={ran}" if ran else ""


# --------------------------------------------------------------------------------------------
# what the engine calls
# --------------------------------------------------------------------------------------------
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
               enable_gqa: bool = False, mask: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one run of equal-length chunks on the CPU, the way this machine does it fastest.

    q: (n, Hq, L, D); k, v: (n, Hkv, L, D), any strides, same dtype; mask: None or (L, L) bool, True
    where attention is allowed (a sliding-window band; ``causal`` is then False); out: None or an
    (n, Hq, L, D) tensor of q's dtype (any strides) a kernel may write into. Returns (n, Hq, L, D) in
    the dtype it was computed in: ``out`` itself when a kernel wrote it, else a new tensor (the caller
    copies it into its output, rounding once).
    """
    choice = cpu_attention(q.dtype, q.shape[-1])
    if mask is None and q.shape[2] <= choice.matmul_max_len:
        return matmul_attention(q.float(), k.float(), v.float(), causal, scale)
    if choice.kernel == "amx" and amx_applies(q, k, v, causal, enable_gqa, mask, scale):
        if out is None or out.stride(-1) != 1 or out.dtype != q.dtype or out.shape != q.shape:
            out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype).transpose(1, 2)
        torch.ops.dice_fast_C.amx_attention(q, k, v, out, scale)
        return out
    work = choice.dtype
    return F.scaled_dot_product_attention(q.to(work), k.to(work), v.to(work), attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=enable_gqa)


AMX_HEAD_DIMS = (32, 64)
AMX_MAX_LEN = 1024


def amx_applies(q, k, v, causal: bool, enable_gqa: bool, mask, scale: float = 1.0) -> bool:
    """Whether the AMX kernel runs this run (else SDPA does): bf16, head size 32 or 64, at most
    `AMX_MAX_LEN` tokens, no mask, not causal, as many K/V heads as query heads, head dims contiguous,
    K's rows under 2^26 elements apart, a positive scale."""
    return (q.dtype == torch.bfloat16 and mask is None and not causal and not enable_gqa and scale > 0
            and q.shape[-1] in AMX_HEAD_DIMS and 0 < q.shape[2] <= AMX_MAX_LEN and q.shape == k.shape == v.shape
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.stride(2) < 1 << 26)


_AMX: dict[str, object] = {}  # "ok": bool, "why": str (once per process)


def amx_kernel() -> tuple[bool, str]:
    """(whether the AMX attention kernel can run here, why not). Checks the CPU's flags first, so a
    CPU without AMX bf16 never builds the C++ extension; on one with it, builds (or loads the cached
    build of) ``dice_fast_C`` and asks the kernel, which also asks Linux for the tile-data permission."""
    with _LOCK_AMX:
        if not _AMX:
            _AMX.update(zip(("ok", "why"), _probe_amx()))
        return bool(_AMX["ok"]), str(_AMX["why"])


def _probe_amx() -> tuple[bool, str]:
    if not has_amx_bf16():
        return False, "this CPU has no AMX bf16 (amx_tile, amx_bf16 and avx512_bf16)"
    from .ops import native

    return native.probe_kernel("amx_attention_supported", "the kernel found no AMX bf16 on this CPU, or the OS "
                               "refused AMX tile data to this process (Linux arch_prctl ARCH_REQ_XCOMP_PERM)")


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


def _env_kernel() -> str:
    return env_choice(ENV_KERNEL, ("sdpa", "amx"))


def _decide(dtype: torch.dtype, head_dim: int) -> CpuAttention:
    env = _env_dtype(dtype)  # read for float32 inputs too, so a bad value is refused whatever the dtype
    forced = torch.float32 if dtype == torch.float32 else env
    kernel_env = _env_kernel()
    if kernel_env == "amx" and dtype == torch.bfloat16:  # other dtypes never run it: SDPA as with "sdpa"
        if forced not in (None, dtype):
            raise OptionError(f"{ENV_KERNEL}=amx attends bf16 in bf16; {ENV_DTYPE}=float32 contradicts it")
        ok, why = amx_kernel()
        if not ok:
            raise OptionError(f"{ENV_KERNEL}=amx, but the AMX attention kernel cannot run here: {why}")
        return CpuAttention(dtype, 0, "env", "amx")
    if forced is not None and kernel_env != "auto":
        return CpuAttention(forced, 0, "env")
    forced_kernels = overrides()
    name = f"{dtype_name(dtype)}/d{head_dim}" + (f" ({forced_kernels})" if forced_kernels else "")
    entry, source = cached_entry(name, _valid,
                                 lambda: measure_cpu_attention(dtype, head_dim))
    measured = getattr(torch, entry["dtype"])
    work = forced if forced is not None else measured
    matmul = 0 if kernel_env != "auto" else int(entry["matmul_max_len"])
    kernel = entry["kernel"] if kernel_env == "auto" and work == measured else "sdpa"
    if kernel == "amx" and not amx_kernel()[0]:  # a cache shared with another machine, or a failed build
        kernel = "sdpa"
    return CpuAttention(work, matmul, "env" if forced is not None and dtype != torch.float32 else source, kernel)


def _valid(entry) -> bool:
    return (isinstance(entry, dict) and entry.get("dtype") in ("float32", "bfloat16", "float16")
            and isinstance(entry.get("matmul_max_len"), int) and entry.get("kernel") in ("sdpa", "amx"))


def measure_cpu_attention(dtype: torch.dtype, head_dim: int = 64, budget_s: float = BUDGET_S) -> dict:
    """Time the CPU attention candidates for ``dtype`` inputs; returns the cache entry:
    {"dtype": winner's name, "matmul_max_len": int, "kernel": "sdpa" | "amx", "ms": {case: milliseconds},
    "date": ...}.

    Cases (12 heads of ``head_dim``, inputs as strided views of packed (tokens, heads, dim)
    projections, output copied back into a packed buffer of ``dtype`` as the engine does):
    ``long``: 2 chunks of 256 tokens, SDPA in float32 (inputs cast) vs in ``dtype`` (half inputs only);
    ``long16``: bf16 on a CPU where the AMX kernel runs (`amx_kernel`): 16 chunks of 256 tokens,
    SDPA in the winner's dtype vs the AMX kernel;
    ``short<L>``: 16 chunks of L tokens, the chosen kernel (named ``_sdpa``) vs the float32 matmul kernel.
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

    def amx(case):
        (q, k, v), out = case
        return lambda: torch.ops.dice_fast_C.amx_attention(q, k, v, out.transpose(1, 2), head_dim**-0.5)

    # before the clock starts: the first call on an AMX CPU builds the C++ extension (~11 s, once per machine)
    amx_ok = (dtype == torch.bfloat16 and head_dim in AMX_HEAD_DIMS and _env_kernel() != "sdpa"
              and amx_kernel()[0])
    deadline = time.perf_counter() + budget_s
    work, ms, kernel = torch.float32, {}, "sdpa"
    if dtype != torch.float32:
        long_case = packed(2, 256)
        low = f"long_{dtype_name(dtype)}"
        ms = race({"long_float32": sdpa_in(torch.float32, long_case), low: sdpa_in(dtype, long_case)},
                   deadline - budget_s / 2)
        work = dtype if ms[low] < _MARGIN * ms["long_float32"] else torch.float32
        if amx_ok and work == dtype:  # the kernel attends bf16 in bf16: not a candidate where float32 won
            wide = packed(16, 256)  # the engine's CPU batch: the kernel's per-head packing is amortised there
            got = race({"long16_sdpa": sdpa_in(work, wide), "long16_amx": amx(wide)}, deadline - budget_s / 4)
            ms.update(got)
            kernel = "amx" if got["long16_amx"] < _MARGIN * got["long16_sdpa"] else "sdpa"
    matmul_max_len = 0
    for length in _MATMUL_LENGTHS:
        if time.perf_counter() > deadline:
            break
        case = packed(16, length)
        chosen = amx(case) if kernel == "amx" else sdpa_in(work, case)
        got = race({f"short{length}_sdpa": chosen, f"short{length}_matmul": mm(case)}, deadline)
        ms.update(got)
        if got.get(f"short{length}_matmul", float("inf")) < _MARGIN * got.get(f"short{length}_sdpa", float("inf")):
            matmul_max_len = length
        else:
            break
    return decision_entry(ms, dtype=dtype_name(work), matmul_max_len=matmul_max_len, kernel=kernel)
