"""``dtype="auto"`` on a CPU: the fastest forward that keeps float32's vectors, measured per machine.

A *path* is a set of `DiceConfig` changes that changes how the forward runs:
``{"dtype": "float32"}``, ``{"dtype": "bfloat16"}``, the same with ``"compile": "on"``, the same
two dtypes with ``"runtime": "openvino"``, and ``{"dtype": "int8"}``; another registers itself with
`register_path`. `choose_path` measures, once per machine and model, every path that can run here
(bf16 only where the CPU has bf16 dot products: avx512_bf16 or AMX; OpenVINO paths only where
OpenVINO is importable, the ``int8`` extra; int8 only with int8 dot products, VNNI or AMX, and NNCF):

* agreement: cosine between its chunk vectors and float32 eager ones on held-out prose (the second
  half of the bundled prose, which int8 never calibrates on: `AGREEMENT_CHUNKS` windows of the
  encoder's chunk size, and 8 chunks of mixed lengths packed together); a path is eligible when the
  minimum is >= the bound, ``auto_agreement``
  (default `AGREEMENT` = 0.999: bf16 rounding). A *lossy* path (int8: cos min 0.995 on MiniLM) is
  not even measured at the default bound (it could not meet it, and its first quantization costs
  minutes); with ``auto_agreement`` below 0.999 it is a candidate like any other;
* speed: document tokens/s of the packed forward on the same chunks (one warm-up, then
  `ROUNDS` timed rounds interleaved across paths, median). A few seconds for MiniLM; a compiled
  path adds its compile once.

The fastest eligible path wins (float32 eager always is eligible: it is the reference). A candidate
whose encoder refuses the other options (an ``OptionError``: OpenVINO with an ``attention`` override, the
compiled forward of a model on the padded fallback) is left out, and the reason kept. The measurement
is cached in the CPU tuning cache (`dice_fast.cpu_tuning`, ``$DICE_FAST_CACHE_DIR/cpu_tuning.json``)
per machine (`cpu_tuning.machine_key`), model (`model_fingerprint`), the options that shape the
forward (`options_key`) and the versions that decide its rates (`versions`); a measurement taken while
other processes competed for the cores is used but not kept. ``print(encoder)`` shows the
choice. Which paths are candidates follows ``compile``: "off" eager only (OpenVINO's included), "on"
compiled only, "auto" both (with an explicit dtype, only that dtype's forwards); and ``runtime``:
None any, "torch" or "openvino" only its own.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .config import DiceConfig, dtype_name
from .errors import OptionError

AGREEMENT = DiceConfig.auto_agreement  # 0.999: the default least cosine to float32 eager, over the measured chunks
AGREEMENT_CHUNKS = 32
ROUNDS = 3
_KEY = "paths"  # the cache file's section (beside the attention choices)
# the measurement's version, in its cache slot: bump it when `measure_paths` or a path's forward changes
PATHS_VERSION = 5
# DiceConfig fields that change neither the chunk vectors `measure_paths` compares nor how fast they are made;
# every other field (chunk size, pooling, attention, prefixes, batch budget, ...) keys the measurement
# (`run_batch`'s chunk vectors come before chunk normalisation; the measured windows are one chunk each, so
# overlap changes nothing; the pipeline changes no vector and only CUDA's default speed)
_NOT_MEASURED = ("dtype", "compile", "runtime", "auto_agreement", "aggregation", "top_k", "temperature", "normalize",
                 "normalize_chunks", "truncate_dim", "query_prefix", "max_chunks_per_document", "calibration", "dedup",
                 "overlap", "pipeline", "cuda_graphs", "device")


@dataclass(frozen=True)
class CpuPath:
    """One way to run the forward: ``options`` (DiceConfig changes); ``usable()`` says why it cannot
    run on this machine (None: it can); ``lossy``: its vectors are further from float32 than bf16
    rounding, so it is a candidate only under a bound below `AGREEMENT`. Every path runs every ``strategy``."""

    name: str
    options: dict
    usable: Callable[[], str | None] = field(default=lambda: None, compare=False)
    lossy: bool = False


@dataclass(frozen=True)
class PathChoice:
    """The chosen path and what was measured: tokens/s and cos min per path name; source "measured" or
    "cache"; bound: the least cos min a path had to keep."""

    name: str
    options: dict
    tokens_per_s: dict
    cos_min: dict
    source: str
    bound: float = AGREEMENT
    refused: dict = field(default_factory=dict)  # name -> why its encoder refused these options

    def __str__(self) -> str:
        rate = self.tokens_per_s.get(self.name)
        return f"{self.name} ({self.source}{f', {rate:,.0f} tok/s' if rate else ''}, cos >= {self.bound:g})"


HALF_UNITS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def half_units(dtype: str) -> str | None:
    """None where the CPU has dot products for ``dtype`` ("bfloat16" / "float16": `HALF_UNITS`; any other
    dtype needs none), else why its matmuls would be emulated."""
    from .cpu_tuning import cpu_flags

    if dtype not in HALF_UNITS or cpu_flags() & set(HALF_UNITS[dtype]):
        return None
    return f"no {' or '.join(HALF_UNITS[dtype])}: {dtype} matmuls are emulated (slower than float32)"


def bf16_units() -> str | None:
    """None where the CPU has bf16 dot products (avx512_bf16 or AMX), else why bf16 is not a candidate."""
    return half_units("bfloat16")


def warn_if_emulated(dtype) -> None:
    """Warn where a PyTorch forward in ``dtype`` (bfloat16 / float16) would run on a CPU without dot products
    for it: its matmuls are emulated (MiniLM on an AVX2-only Zen 3: bf16 6.1-6.8x, fp16 4.8x slower than float32, RESULTS §18.13)."""
    import warnings

    name = dtype_name(dtype)
    if half_units(name) is not None:
        warnings.warn(f"dtype={name!r} on a CPU without {' or '.join(HALF_UNITS[name])}: its matmuls are emulated, "
                      "several times slower than float32 (MiniLM on an AVX2-only Zen 3: bf16 ~6x, fp16 ~5x); "
                      "vectors stay within half-precision rounding. Use dtype='float32', or dtype='auto' to measure",
                      RuntimeWarning, stacklevel=4)


def _not_installed(*modules: str) -> str | None:
    """None where every module of the ``int8`` extra named is importable (checked without importing
    them), else which are missing and how to install them."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{' and '.join(missing)} not installed (pip install 'dice-fast[int8]')" if missing else None


def openvino_units() -> str | None:
    """None where OpenVINO is importable (checked without importing it) and a model can be exported to it
    (TorchScript on), else why its paths cannot run."""
    from .quant.cpu import tracing_off

    return _not_installed("openvino") or tracing_off()


def openvino_bf16_units() -> str | None:
    """None where OpenVINO can run bf16 here (bf16 units and OpenVINO), else why not."""
    return bf16_units() or openvino_units()


def int8_units() -> str | None:
    """None where the int8 path can run: int8 dot products (VNNI / AMX) and OpenVINO + NNCF importable
    (checked without importing them), else why not. ``DICE_FAST_INT8_ANY_CPU`` does not apply here."""
    from .cpu_tuning import cpu_flags
    from .quant.cpu import int8_dot_instructions

    if not int8_dot_instructions(cpu_flags()):
        return "no VNNI / AMX int8 dot products"
    from .quant.cpu import tracing_off

    return _not_installed("openvino", "nncf") or tracing_off()


def compiler_units() -> str | None:
    """None where the compiled forward can be built here (torch.compile on, a C++ compiler for inductor),
    else why not."""
    from .compiled import compiler_missing

    return compiler_missing("cpu")


def bf16_compiler_units() -> str | None:
    return bf16_units() or compiler_units()


PATHS: list[CpuPath] = [
    CpuPath("fp32", {"dtype": "float32", "compile": "off", "runtime": "torch"}),
    CpuPath("bf16", {"dtype": "bfloat16", "compile": "off", "runtime": "torch"}, bf16_units),
    CpuPath("fp32+compile", {"dtype": "float32", "compile": "on", "runtime": "torch"}, compiler_units),
    CpuPath("bf16+compile", {"dtype": "bfloat16", "compile": "on", "runtime": "torch"}, bf16_compiler_units),
    CpuPath("fp32+openvino", {"dtype": "float32", "compile": "off", "runtime": "openvino"}, openvino_units),
    CpuPath("bf16+openvino", {"dtype": "bfloat16", "compile": "off", "runtime": "openvino"}, openvino_bf16_units),
    CpuPath("int8", {"dtype": "int8", "compile": "off"}, int8_units, lossy=True),
]
REFERENCE = "fp32"


def register_path(path: CpuPath) -> None:
    """Add a candidate (e.g. an int8 path); replaces one of the same name."""
    PATHS[:] = [p for p in PATHS if p.name != path.name] + [path]


def candidates(dtype: str, compile: str, bound: float = AGREEMENT, runtime: str | None = None) -> list[CpuPath]:
    """The paths `choose_path` considers for the ``dtype`` / ``compile`` / ``runtime`` (None: any) options
    and the agreement ``bound``, the reference first (lossy paths only under a bound below `AGREEMENT`)."""
    want = {"off": ("off",), "on": ("on",), "auto": ("off", "on")}[compile]
    return [p for p in PATHS if p.options.get("compile", "off") in want
            and (dtype == "auto" or p.options.get("dtype") == dtype) and (bound < AGREEMENT or not p.lossy)
            and runtime in (None, path_runtime(p))]


def path_runtime(path: CpuPath) -> str:
    """What runs ``path``'s forward: its ``runtime`` option, else OpenVINO for int8 and PyTorch otherwise."""
    return path.options.get("runtime") or ("openvino" if path.options.get("dtype") == "int8" else "torch")


def choose_path(encoder_for: Callable, model, dtype: str, compile: str, measure: Callable | None = None,
                model_key: str | None = None, bound: float = AGREEMENT, runtime: str | None = None,
                options_key: str = "") -> PathChoice:
    """The fastest path whose cos min is >= ``bound`` (see the module docstring).

    encoder_for(options) -> a `DiceEncoder` running a copy of the model with ``options`` (an
    ``OptionError`` leaves that path out; any other failure to build it too, and the measurement is then
    used but not cached); measure(encoders {name: encoder}, reference encoder) ->
    ({name: tokens/s}, {name: cos min}, busy) (default `measure_paths`; tests inject their own).
    Cached under ``model_key`` (default: the model's fingerprint) and ``options_key`` (`options_key`
    of the encoder's settings).
    """
    from . import cpu_tuning

    listed = candidates(dtype, compile, bound, runtime)
    paths = [p for p in listed if p.usable() is None]
    if not paths:
        why = "; ".join(f"{p.name}: {p.usable()}" for p in listed) or "none is a candidate of these options"
        raise OptionError(f"dtype={dtype!r}, compile={compile!r}, runtime={runtime!r}, auto_agreement={bound}: "
                          f"no candidate path runs on this CPU ({why})")
    if model_key is None:
        from .reuse.keys import model_fingerprint

        model_key = model_fingerprint(model)
    names = ",".join(p.name for p in paths)
    # the measurement (the bound applies below); one under a DICE_FAST_CPU_* override is kept apart
    slot = f"{model_key}|{names}|held-out|{options_key}|{versions()}|{cpu_tuning.overrides()}"
    entry = cpu_tuning.cached(_KEY, slot)
    source = "cache"
    if not _valid(entry, paths):
        encoders, refused, failed = {}, {}, False
        for p in paths:
            try:
                encoders[p.name] = encoder_for(p.options)
            except OptionError as exc:  # this path cannot run the other options: left out, the reason kept
                refused[p.name] = str(exc)
            except Exception as exc:  # noqa: BLE001 - a build that failed here (a broken compiler, an export):
                refused[p.name] = f"failed to build: {type(exc).__name__}: {str(exc).strip()[:300]}"  # not cached
                failed = True
        rates, agreement, busy = {}, {}, False
        if encoders:  # (every candidate refused: nothing to measure, and no reference to build)
            reference = encoders.get(REFERENCE) or encoder_for(PATHS[0].options)
            rates, agreement, busy = (measure or measure_paths)(encoders, reference)
        # a path whose vectors hold a NaN is kept, never eligible: -1 (and no rate), not re-measured each time
        entry = {"tokens_per_s": {n: r if _finite(r) else 0.0 for n, r in rates.items()},
                 "cos_min": {n: c if _finite(c) else -1.0 for n, c in agreement.items()},
                 "refused": refused, "date": datetime.datetime.now().isoformat(timespec="seconds")}
        source = "measured"
        if not busy and not failed:
            cpu_tuning.store(entry, _KEY, slot)  # beside the candidates' attention and linear choices made since
    refused = entry.get("refused", {})
    runs = [p for p in paths if p.name not in refused]
    if not runs:
        raise OptionError(f"dtype={dtype!r}, compile={compile!r}: every candidate path refuses these options ("
                          + "; ".join(f"{n}: {why}" for n, why in refused.items()) + ")")
    eligible = [p for p in runs if p.name == REFERENCE or entry["cos_min"][p.name] >= bound]
    if not eligible:
        raise OptionError(f"no path meets the agreement bound auto_agreement={bound}: measured cos min "
                          f"{entry['cos_min']}")
    best = max(eligible, key=lambda p: entry["tokens_per_s"][p.name])
    return PathChoice(best.name, dict(best.options), dict(entry["tokens_per_s"]), dict(entry["cos_min"]), source,
                      bound, dict(refused))


def options_key(cfg) -> str:
    """A digest of the `DiceConfig` fields that shape what `measure_paths` measures (all but `_NOT_MEASURED`):
    a measurement taken under another chunk size, pooling or attention never decides for these."""
    shaping = {f: repr(getattr(cfg, f)) for f in DiceConfig.field_names() if f not in _NOT_MEASURED}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


def versions() -> str:
    """The versions a measurement's rates and cosines depend on besides torch (in the machine key): this
    measurement's, transformers', and OpenVINO's and NNCF's where installed (read without importing them)."""
    from importlib import metadata

    found = [f"paths {PATHS_VERSION}"]
    for dist in ("transformers", "openvino", "nncf"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def _valid(entry, paths) -> bool:
    """Whether a cached ``entry`` holds, for every path, its refusal or a finite rate and cos min (else: measured again)."""
    refused = entry.get("refused", {}) if isinstance(entry, dict) else None
    return isinstance(refused, dict) and all(isinstance(entry.get(k), dict) and all(_finite(entry[k].get(p.name)) for p in paths
                                                      if p.name not in refused)
               for k in ("tokens_per_s", "cos_min"))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def measure_paths(encoders: dict, reference) -> tuple[dict, dict, bool]:
    """({name: document tokens/s}, {name: min cosine to ``reference``}, busy) of each encoder on
    `AGREEMENT_CHUNKS` windows of held-out prose, packed as batches of each encoder's own budget (under
    late chunking, windows of a late window's text: their speed is not a chunk's)."""
    from .data import prose_halves, token_windows
    from .packing import pack_plan
    from . import cpu_tuning

    late = reference.config.strategy == "late"
    size = reference.settings.late_windows()[0] if late else reference.config.chunk_size
    texts = token_windows(reference.tokenizer, "\n\n".join(prose_halves()[1]), AGREEMENT_CHUNKS, size)
    plan = reference.plan(texts)
    # the agreement also on chunks of mixed lengths in one batch: a path that pads them (OpenVINO) is
    # checked where padding can go wrong, not only on the equal-length windows it is timed on
    mixed = reference.plan([t[: max(1, len(t) * (i + 1) // 8)] for i, t in enumerate(texts[:8])])
    packed: dict = {}  # per (plan, token budget): int8 batches by its own (8192), the float paths by 4096

    def batches(p, budget: int):
        if (id(p), budget) not in packed:
            if late:  # whole windows per batch
                per, window = max(1, budget // int(p.window_lengths.max())), p.windows.chunk_window
                picks = [np.flatnonzero((window >= lo) & (window < lo + per)) for lo in range(0, len(p.windows.length), per)]
            else:
                per = max(1, budget // int(p.chunk_lengths.max()))
                picks = [np.arange(lo, min(lo + per, p.n_chunks)) for lo in range(0, p.n_chunks, per)]
            packed[id(p), budget] = [pack_plan(p, ids, reference.spec.first_position) for ids in picks]
        return packed[id(p), budget]

    def run(enc, p=plan):
        return np.concatenate([enc.run_batch(b).cpu().numpy() for b in batches(p, enc.max_batch_tokens)])

    def cos_min(enc):
        # np.min, not min(): a NaN (a path whose vectors hold one) must win
        return float(np.min([np.min(np.sum(_unit(run(enc, p)) * want[id(p)], axis=1)) for p in (plan, mixed)]))

    want = {id(p): _unit(run(reference, p)) for p in (plan, mixed)}
    agreement = {name: cos_min(enc) for name, enc in encoders.items()}
    times: dict[str, list] = {name: [] for name in encoders}
    for _ in range(ROUNDS):
        cpu_tuning.sample_others()
        for name, enc in encoders.items():
            t0 = time.perf_counter()
            run(enc)
            times[name].append(time.perf_counter() - t0)
    tokens = int(plan.tokens.lengths.sum())
    rates = {name: tokens / float(np.median(t)) for name, t in times.items()}
    return rates, agreement, cpu_tuning.busy(cpu_tuning.measured_load())


def _unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def resolve(encoder_cls, model, tokenizer, cfg, model_path=None, measure=None, model_key=None):
    """(cfg with the chosen path's options, `PathChoice`) for an encoder built with ``dtype="auto"``
    or ``compile="auto"``; each candidate runs on its own copy of ``model`` (the caller's is untouched)."""
    from .settings import parse_device

    param = next(model.parameters())
    device = parse_device(cfg.device) if cfg.device is not None else param.device
    if device.type != "cpu":
        raise OptionError(f"dtype='auto' and compile='auto' choose among CPU forwards; on {device} pass an explicit "
                         "dtype (bfloat16) and compile ('off' or 'on')")
    dtype = cfg.dtype if cfg.dtype is not None else dtype_name(param.dtype)

    def encoder_for(options):
        return encoder_cls(copy.deepcopy(model), tokenizer, config=cfg.replace(**options), model_path=model_path)

    choice = choose_path(encoder_for, model, dtype, cfg.compile, measure=measure, model_key=model_key,
                         bound=cfg.auto_agreement, runtime=cfg.runtime,
                         options_key=options_key(cfg))
    return cfg.replace(**choice.options), choice
