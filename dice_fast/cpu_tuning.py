"""The per-machine tuning cache, and the timing every CPU speed choice is made with.

The CPU choices that are measured rather than assumed (the attention kernel, `dice_fast.cpu_attention`;
the linear kernel, `dice_fast.cpu_linear`; the bf16 LayerNorm, `dice_fast.cpu_layer_norm`; the linear +
GELU fusion, `dice_fast.cpu_fusion`; the ``dtype="auto"`` path, `dice_fast.cpu_paths`) time their
candidates with `race` (two kernels: `kernel_race`, remembered per process by `decided_kernel`, with
`env_choice` reading the variable that decides without measuring), or their own rounds, sampling the
machine's load with `sample_others`, and keep the answer in one JSON file per user, under this machine's key:

    entry, source = cpu_tuning.cached_entry("linear/float32", valid, measure)  # cached, else measured and kept
    cpu_tuning.cached("paths", slot); cpu_tuning.store(entry, "paths", slot)   # nested sections

* **Where**: ``$DICE_FAST_CACHE_DIR/cpu_tuning.json``, else ``$XDG_CACHE_HOME/dice_fast``, else
  ``~/.cache/dice_fast``. A folder that cannot be written costs a measurement in every process,
  and a warning (once per file) says so.
* **Key** (`machine_key`): CPU model, the ISA flags that decide speed, the thread count and the torch
  version (which brings its oneDNN and MKL); where set, relaxed float32 matmuls and the variables that
  cap the kernels' instructions (`ISA_CAPS`). Entries also carry `RACE_VERSION`, so entries timed another
  way are measured again.
* **Contention**: a measurement taken while other processes held the cores (``busy``) is used, not kept.
* **Writers**: `store` re-reads the file and writes it whole, atomically, under a thread lock and
  (POSIX) an advisory lock on ``cpu_tuning.json.lock``, so concurrent threads and processes keep each
  other's entries. A damaged or hand-edited file costs a measurement, never an error.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
import warnings
from pathlib import Path

import torch

from .errors import OptionError
from .runinfo import cpu_model
from .side_files import replace_file

CACHE_FILE = "cpu_tuning.json"
BUDGET_S = 0.6  # wall-clock cap of one micro-benchmark (the first bf16 forward pays it once per machine)
# the timing method's version, stamped in every cached decision: entries `race` timed another way are
# measured again (2: each kernel's first call untimed, so a lazily initialised kernel is not dropped;
# 3: a kernel is dropped as emulated only if three timed calls all say so, not one preempted call)
RACE_VERSION = 3
_DROP = 8  # a kernel slower than this many times the fastest on its first calls is dropped (emulated)
_RETRIES = 2  # timed calls a would-be-dropped kernel gets beside its first


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
_SAMPLES: list[int] = []


def sample_others() -> None:
    """Record how many runnable threads besides this process's compute threads the kernel sees now
    (the 4th field of /proc/loadavg; nothing where there is none)."""
    try:
        with open("/proc/loadavg", encoding="utf-8") as fh:
            running = int(fh.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return
    _SAMPLES.append(max(0, running - torch.get_num_threads()))


def measured_load() -> float:
    """Mean runnable threads of other work seen while measuring (0 on a quiet machine)."""
    load = sum(_SAMPLES) / len(_SAMPLES) if _SAMPLES else 0.0
    _SAMPLES.clear()
    return round(load, 2)


def busy(load: float) -> bool:
    """Whether ``load`` (`measured_load`: other runnable threads seen while measuring) means the cores were
    contended: a timing taken then is used but not cached."""
    return load >= 0.5 * max(1, (os.cpu_count() or 1) - torch.get_num_threads() + 1)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def race(fns: dict, deadline: float, max_rounds: int = 7) -> dict:
    """Best-of-k milliseconds of each function, interleaved until ``deadline``.

    Each function gets an untimed call first (a kernel's first call in a process can cost 50x its
    next) and then at least one timed call. A function over `_DROP` times the fastest is timed
    `_RETRIES` more times (one preempted call must not drop it) and, if it stays that slow, dropped
    from the rounds (an emulated kernel: bf16 matmuls without bf16 instructions); it keeps its best time.
    """
    sample_others()
    first = {}
    for name, fn in fns.items():
        fn()
        first[name] = _timed(fn)
    for name, fn in fns.items():
        for _ in range(_RETRIES):
            if first[name] <= _DROP * min(first.values()):
                break
            first[name] = min(first[name], _timed(fn))
    alive = {n: f for n, f in fns.items() if first[n] <= _DROP * min(first.values())}
    best = dict(first)
    for r in range(max_rounds):
        sample_others()
        if r and time.perf_counter() > deadline:
            break
        for name, fn in alive.items():
            best[name] = min(best[name], _timed(fn))
    return {n: t * 1e3 for n, t in best.items()}


def kernel_race(fns: dict, challenger: str, incumbent: str, margin: float, budget_s: float = BUDGET_S) -> dict:
    """`race` two kernels ({name: fn}) and return the cache entry (`decision_entry` with "kernel"):
    ``challenger`` where its time is under ``margin`` x ``incumbent``'s, else ``incumbent``."""
    ms = race(fns, time.perf_counter() + budget_s)
    return decision_entry(ms, kernel=challenger if ms[challenger] < margin * ms[incumbent] else incumbent)


def decision_entry(ms: dict, **decision) -> dict:
    """A measured decision as the cache keeps it: the ``decision`` fields, then "ms" (``ms`` rounded),
    "threads", "load", "busy" (other processes held the cores: `cached_entry` will not keep it), "date"."""
    load = measured_load()
    return {**decision, "ms": {key: round(v, 4) for key, v in ms.items()}, "threads": torch.get_num_threads(),
            "load": load, "busy": busy(load), "date": datetime.datetime.now().isoformat(timespec="seconds")}


# --------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------
def cache_path() -> Path:
    """Where decisions are cached: ``$DICE_FAST_CACHE_DIR``, else ``$XDG_CACHE_HOME/dice_fast``, else ``~/.cache/dice_fast``."""
    root = os.environ.get("DICE_FAST_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dice_fast")
    return Path(root) / CACHE_FILE


def cpu_flags() -> set[str]:
    """The CPU's feature flags that decide speed choices (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_amx_bf16() -> bool:
    """Whether the CPU has AMX bf16 tiles (amx_tile, amx_bf16) and avx512_bf16, by `cpu_flags`: what the
    AMX attention kernel (`dice_fast.cpu_attention`) and the bf16 batch budget on AMX (`dice_fast.settings`)
    need."""
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags()


def has_avx512_bf16() -> bool:
    """Whether the CPU has AVX-512 (f, bw, vl) with bf16 conversions (avx512_bf16), by `cpu_flags`: what
    the bf16 LayerNorm kernel (`dice_fast.cpu_layer_norm`) needs."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


def machine_key() -> str:
    """CPU model, the ISA flags that matter, threads and torch version (and relaxed float32 matmuls,
    `float32_matmuls`): a cache entry is reused only there."""
    model = cpu_model()
    isa = sorted(f for f in cpu_flags() if f in ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16",
                                                 "avx512f", "avx2", "avx_vnni"))
    relaxed = float32_matmuls("cpu")
    caps = ",".join(f"{k}={os.environ[k].strip()}" for k in ISA_CAPS if os.environ.get(k, "").strip())
    return (f"{model} | {','.join(isa) or 'no-isa-flags'} | {torch.get_num_threads()} threads | torch {torch.__version__}"
            + (f" | float32 matmuls in {relaxed}" if relaxed else "") + (f" | {caps}" if caps else ""))


# variables that cap the instructions torch's kernels (ATen) or oneDNN use below what the flags say: a
# choice measured under a cap (bf16 emulated, a narrower vector width) never decides for the uncapped CPU
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA")


def float32_matmuls(device_type: str) -> str | None:
    """What torch's float32 matmuls run in on ``device_type`` where that is not float32, else None: "tf32"
    on CUDA, "bf16" (or "tf32") on a CPU with bf16 units, after ``torch.set_float32_matmul_precision("high")``
    or ``"medium"``, ``allow_tf32`` or the backends' ``fp32_precision`` (a CPU without bf16 units computes
    float32 whatever it says: measured, RESULTS §32)."""
    if device_type not in ("cpu", "cuda"):
        return None
    matmul = getattr(getattr(torch.backends, "cuda" if device_type == "cuda" else "mkldnn", None), "matmul", None)
    try:
        relaxed = getattr(matmul, "fp32_precision", None)
        if relaxed is None and device_type == "cuda":  # a torch before the fp32_precision settings
            relaxed = "tf32" if getattr(matmul, "allow_tf32", False) else None
    except RuntimeError:  # a torch that cannot say
        return None
    if relaxed in ("ieee", "none", None):
        return None
    if device_type == "cpu" and not ({"avx512_bf16", "amx_bf16"} & cpu_flags()):
        return None
    return str(relaxed)


def overrides() -> str:
    """The ``DICE_FAST_CPU_*`` variables set in this process, as "NAME=value,..." ("" when none): a
    decision measured under an override (an A/B run with one kernel switched off) is kept under a name of
    its own, so it never decides for the defaults."""
    return ",".join(f"{k}={v.strip()}" for k, v in sorted(os.environ.items())
                    if k.startswith("DICE_FAST_CPU_") and v.strip())


def env_choice(env: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``env`` that overrides a measured choice: "auto" (unset or empty: measure)
    or one of ``choices``; `OptionError` naming the variable and the values it takes otherwise."""
    raw = os.environ.get(env, "auto").strip().lower() or "auto"
    if raw not in ("auto", *choices):
        raise OptionError(f"{env} must be auto, {', '.join(choices[:-1])} or {choices[-1]}, got {raw!r}")
    return raw


def decided_kernel(memo: dict, name: str, kernels: tuple[str, ...], measure) -> str:
    """The winner of the race ``name`` on this machine, one of ``kernels``: from ``memo`` (the caller's, for
    its process), else `cached_entry` (the cache file, else ``measure()``), then kept in ``memo``."""
    if name not in memo:
        entry, _ = cached_entry(name, lambda e: isinstance(e, dict) and e.get("kernel") in kernels, measure)
        memo[name] = entry["kernel"]
    return memo[name]


def cached_entry(name: str, valid, measure) -> tuple[dict, str]:
    """(entry, source) of the decision ``name`` on this machine: the cached entry where ``valid(entry)``
    ("cache"), else ``measure()``'s ("measured"), kept in the cache unless its ``busy`` flag says other
    work held the cores while it was timed (a contended timing is used, not kept)."""
    entry = cached(name)
    if valid(entry) and entry.get("race") == RACE_VERSION:
        return entry, "cache"
    entry = {**measure(), "race": RACE_VERSION}
    if not entry["busy"]:
        store(entry, name)
    return entry, "measured"


def cached(*names: str):
    """The entry at ``cache[machine_key()][names[0]]...[names[-1]]`` in the cache file, None where absent."""
    return cache_section(read_cache(), *names[:-1]).get(names[-1])


_WRITE = threading.Lock()


def store(entry: dict, *names: str) -> None:
    """Keep ``entry`` at `cached`'s place, in the file as it is now: read, changed and written under
    the writers' locks, so what other threads and processes stored meanwhile is kept."""
    path = cache_path()
    with _WRITE, _file_lock(path):
        cache = read_cache()
        cache_section(cache, *names[:-1])[names[-1]] = entry
        write_cache(cache)


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock on ``path`` + ".lock" for a read-modify-write of ``path`` (nothing
    where the platform has no ``fcntl``, the file system refuses locks, or the folder cannot be
    written: `write_cache` says so)."""
    try:
        import fcntl
    except ImportError:  # Windows: the thread lock alone
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path.with_name(path.name + ".lock"), "a", encoding="utf-8")
    except OSError:
        yield
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except OSError:  # ENOLCK: a network home without a lock daemon; the thread lock alone, as on Windows
            pass
        yield  # released when the file closes


def cache_section(cache: dict, *names: str) -> dict:
    """``cache[machine_key()][names[0]]...``: this machine's (nested) section of the cache, made where
    missing and in place of anything that is not a dict (a damaged or hand-edited file costs a
    measurement, never an error)."""
    node = cache
    for name in (machine_key(), *names):
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    return node


def read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


_WARNED: set[str] = set()


def write_cache(data: dict) -> None:
    """Atomic write. A folder that cannot be written costs re-measuring in the next process, and a
    warning (once per file and process) that names it and ``DICE_FAST_CACHE_DIR``."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps(data, indent=1, sort_keys=True))  # a power loss keeps every machine's entries
    except OSError as exc:
        if str(path) not in _WARNED:
            _WARNED.add(str(path))
            warnings.warn(f"cannot write the CPU tuning cache {path} ({exc.strerror or exc}): every process will "
                          "measure its CPU choices again; set DICE_FAST_CACHE_DIR to a writable folder",
                          RuntimeWarning, stacklevel=3)
