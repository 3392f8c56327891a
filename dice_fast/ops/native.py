"""The C++/CUDA twins of the pooling op (``csrc/``), compiled on demand.

    from dice_fast.ops import native
    native.build()                      # once per process: compiles (cached on disk) and loads
    chunks = native.pool_chunks_native(hidden, cu_seqlens, "mean")

Importing this module compiles nothing and loads nothing; `is_loaded` never triggers a build.
`build` compiles ``csrc/`` with ``torch.utils.cpp_extension.load`` (ninja) into the library
``dice_fast_C`` whose ops land in ``torch.ops.dice_fast_C`` (``pool_chunks``,
``aggregate_documents``). The CPU kernels are always built; the CUDA kernels when ``with_cuda``
(default: a GPU is visible and the CUDA toolkit is found). Build products are cached under
``$TORCH_EXTENSIONS_DIR`` (else ``$XDG_CACHE_HOME/dice_fast``, else ``~/.cache/dice_fast``), in a
folder named after the Python, torch, CUDA and CPU-vector-ISA versions, so a cache shared between
machines never hands one machine another's binary; rebuilding after a source change is automatic.

Where ``csrc/`` comes from: ``$DICE_FAST_CSRC`` if set (an `OptionError` when that folder lacks the
sources: never the stock ones instead), else the repository checkout next to this package (editable
install), else ``dice_fast/_csrc`` (a wheel that ships the sources as package data).

Environment knobs: ``DICE_FAST_CPU_CAPABILITY`` = ``DEFAULT`` | ``AVX2`` | ``AVX512`` overrides the
vector ISA the CPU kernels are compiled for (default: what ATen detects on this CPU);
``TORCH_CUDA_ARCH_LIST`` picks the GPU architectures (default: the visible GPUs').
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import OptionError
from ..folder_guard import folder_guard
from .spec import check_aggregate_inputs, check_pool_chunks_inputs

__all__ = [
    "build",
    "is_loaded",
    "has_cuda_kernels",
    "csrc_dir",
    "probe_kernel",
    "pool_chunks_native",
    "aggregate_documents_native",
]

LIB_NAME = "dice_fast_C"
CPU_SOURCES = ("register.cpp", "segment_pool_cpu.cpp", "attention_cpu_amx.cpp", "layer_norm_cpu.cpp")
CUDA_SOURCES = ("segment_pool_cuda.cu",)
HEADERS = ("segment_pool.h",)

# flags ATen itself uses for its per-ISA kernels (aten/src/ATen/native/cpu), plus the defines that
# select at::vec::Vectorized's implementation for that ISA
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}

_HOW_TO = (
    "Build it once per process with `dice_fast.ops.native.build()` (needs a C++ compiler and ninja: "
    "`pip install ninja`), or use the vectorised PyTorch implementation, impl='torch' "
    "(impl='auto' falls back to it)."
)


# --------------------------------------------------------------------------------------------
# state (no side effects at import)
# --------------------------------------------------------------------------------------------
def is_loaded() -> bool:
    """True when the ops of ``dice_fast_C`` are registered in this process. Never builds anything."""
    try:
        torch.ops.dice_fast_C.pool_chunks  # noqa: B018  (lookup only)
    except (AttributeError, RuntimeError):
        return False
    return True


def has_cuda_kernels() -> bool:
    """True when the loaded extension has CUDA kernels (it was built with CUDA)."""
    if not is_loaded():
        return False
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"{LIB_NAME}::pool_chunks", "CUDA"))


def csrc_dir() -> Path:
    """The folder holding the C++/CUDA sources (see the module docstring for the search order)."""
    if given := os.environ.get("DICE_FAST_CSRC"):  # a folder named is the one meant: never another instead
        if missing := [f for f in CPU_SOURCES + HEADERS if not (Path(given) / f).is_file()]:
            raise OptionError(f"$DICE_FAST_CSRC={given!r} is not a dice_fast csrc/ folder: it lacks "
                              f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        return Path(given)
    here = Path(__file__).resolve()
    candidates = [here.parents[2] / "csrc", here.parents[1] / "_csrc"]
    for c in candidates:
        if all((c / f).is_file() for f in CPU_SOURCES + HEADERS):
            return c
    raise RuntimeError(
        "the dice_fast C++ sources (csrc/) were not found; looked in: "
        + ", ".join(str(c) for c in candidates)
        + ". Reinstall dice_fast (its wheel ships them as dice_fast/_csrc), or point DICE_FAST_CSRC at csrc/."
    )


# --------------------------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------------------------
def _cpu_capability() -> str:
    forced = os.environ.get("DICE_FAST_CPU_CAPABILITY", "").strip().upper()
    if forced:
        if forced not in _ISA_FLAGS:
            raise OptionError(f"DICE_FAST_CPU_CAPABILITY must be one of {', '.join(_ISA_FLAGS)}, got {forced!r}")
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64") or os.name == "nt":
        return "DEFAULT"
    try:
        cap = torch.backends.cpu.get_cpu_capability()  # what ATen dispatches to on this CPU
    except Exception:  # very old torch
        return "DEFAULT"
    return cap if cap in _ISA_FLAGS else "DEFAULT"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "cl" if os.name == "nt" else "c++")
    path = shutil.which(cxx)
    if path is None:
        raise RuntimeError(
            f"building the dice_fast C++ extension needs a C++ compiler, but {cxx!r} was not found on PATH "
            "(install g++ or clang, or set CXX). " + _HOW_TO
        )
    return path


_OPENMP_OK: dict[str, bool] = {}


def _openmp_works(cxx: str) -> bool:
    """Whether ``cxx -fopenmp`` compiles and links a tiny OpenMP program (cached per compiler)."""
    if cxx in _OPENMP_OK:
        return _OPENMP_OK[cxx]
    ok = False
    if os.name != "nt":
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "omp.cpp"
            src.write_text("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
            try:
                cmd = [cxx, "-fopenmp", str(src), "-o", str(Path(tmp) / "omp")]
                r = subprocess.run(cmd, capture_output=True, timeout=120)
                ok = r.returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
    _OPENMP_OK[cxx] = ok
    return ok


def _build_root() -> Path:
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dice_fast"


def _variant(with_cuda: bool, cap: str) -> str:
    torch_v = torch.__version__.split("+")[0]
    cuda_v = f"cu{torch.version.cuda.replace('.', '')}" if with_cuda and torch.version.cuda else "cpu"
    return f"py{sys.version_info[0]}{sys.version_info[1]}_torch{torch_v}_{cuda_v}_{cap.lower()}"


_BUILT: dict = {}


def _reach_installed_ninja() -> None:
    """Put the ninja pip installed with dice_fast on PATH when PATH has none (torch looks there only): a
    virtual environment's python run by its path (systemd, a container's CMD, pipx), not activated, has
    its ``bin`` off PATH, and the C++ kernels were then silently off."""
    if shutil.which("ninja") is not None:
        return
    folders = [Path(sys.executable).parent]
    try:
        import ninja

        folders.insert(0, Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for folder in folders:
        if shutil.which("ninja", path=str(folder)) is not None:
            os.environ["PATH"] = str(folder) + os.pathsep + os.environ.get("PATH", "")
            return


def build(verbose: bool = False, with_cuda: bool | None = None) -> str:
    """Compile (or reuse the cached build of) ``csrc/`` and load it; return the library's path.

    with_cuda: also compile the CUDA kernels; default: True when a GPU is visible and the CUDA
    toolkit (nvcc, ``CUDA_HOME``) is found. Idempotent: once loaded, later calls return at once
    (a library cannot be reloaded, so ``with_cuda=True`` after a CPU-only build raises).
    Raises RuntimeError with what is missing (compiler, ninja, CUDA toolkit) or the compiler's
    output; on failure nothing is loaded, so `is_loaded` stays False.
    """
    from torch.utils import cpp_extension

    cuda_home = cpp_extension.CUDA_HOME
    if is_loaded():
        if with_cuda and not has_cuda_kernels():
            raise RuntimeError(
                "the dice_fast C++ extension is already loaded in this process without CUDA kernels; "
                "a library cannot be reloaded: call build(with_cuda=True) in a fresh process"
            )
        return _BUILT.get("path", "<loaded>")

    nvcc = Path(cuda_home) / "bin" / ("nvcc.exe" if os.name == "nt" else "nvcc") if cuda_home else None
    has_nvcc = nvcc is not None and nvcc.is_file()
    if with_cuda is None:
        with_cuda = torch.cuda.is_available() and has_nvcc
    cxx = _compiler()
    _reach_installed_ninja()
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as e:
        raise RuntimeError(f"building the dice_fast C++ extension needs ninja ({e}): `pip install ninja`.") from e
    if with_cuda:
        if torch.version.cuda is None:
            raise RuntimeError(
                f"build(with_cuda=True) needs a CUDA build of torch; this one is {torch.__version__} without CUDA"
            )
        if not has_nvcc:
            raise RuntimeError(
                "build(with_cuda=True) needs the CUDA toolkit (nvcc) matching torch's CUDA "
                f"{torch.version.cuda}; none was found: install it and set CUDA_HOME, or build(with_cuda=False)"
            )

    src = csrc_dir()
    sources = [str(src / f) for f in CPU_SOURCES]
    if with_cuda:
        missing = [f for f in CUDA_SOURCES if not (src / f).is_file()]
        if missing:
            raise RuntimeError(f"CUDA sources missing from {src}: {', '.join(missing)}")
        sources += [str(src / f) for f in CUDA_SOURCES]

    cap = _cpu_capability()
    if os.name == "nt":
        cflags, ldflags = ["/O2"], []
    else:
        cflags = ["-O3", f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}", *_ISA_FLAGS[cap]]
        ldflags = []
        if _openmp_works(cxx):  # at::parallel_for is an inline OpenMP loop: without -fopenmp it runs serially
            cflags.append("-fopenmp")
            ldflags.append("-fopenmp")
    cuda_cflags = ["-O3", "-lineinfo"]

    build_dir = _build_root() / f"{LIB_NAME}_{_variant(bool(with_cuda), cap)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with folder_guard(build_dir, best_effort=True) as held:  # one dice_fast build of the folder at a time
        if held:  # torch's lock file, which its builds wait on without end: under ours, one there is a killed build's
            (build_dir / "lock").unlink(missing_ok=True)
        try:
            path = cpp_extension.load(
                name=LIB_NAME,
                sources=sources,
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_cflags,
                extra_ldflags=ldflags,
                extra_include_paths=[str(src)],
                build_directory=str(build_dir),
                verbose=verbose,
                with_cuda=bool(with_cuda),
                is_python_module=False,
            )
        except Exception as e:  # compiler errors arrive as RuntimeError with the build log
            raise RuntimeError(
                f"building the dice_fast C++ extension in {build_dir} failed "
                f"(compiler {cxx}, CPU ISA {cap}, CUDA {'on' if with_cuda else 'off'}); "
                "rerun with build(verbose=True) for the full log (if the compiler rejects the vector-ISA flags, "
                f"set DICE_FAST_CPU_CAPABILITY=DEFAULT). Cause: {e}"
            ) from e
    if not is_loaded():  # never a hollow install
        raise RuntimeError(f"the dice_fast C++ extension was built at {path} but its ops did not register")
    _BUILT.update(path=str(path), with_cuda=bool(with_cuda), cpu_capability=cap, build_dir=str(build_dir))
    return str(path)


def probe_kernel(supported_op: str, unsupported_why: str) -> tuple[bool, str]:
    """(whether a CPU kernel of ``dice_fast_C`` runs here, why not): builds (or loads) the library and calls
    its op ``supported_op`` (e.g. "amx_attention_supported"); ``unsupported_why`` is the answer when that
    says no. Any failure to build or load (no compiler, a read-only cache folder, a bad
    ``DICE_FAST_CPU_CAPABILITY``) is an answer too, never raised: the caller keeps torch's kernel."""
    try:
        build()
        if not getattr(torch.ops.dice_fast_C, supported_op)():
            return False, unsupported_why
    except Exception as e:  # noqa: BLE001 - reported by the caller's probe, never raised into an encode
        return False, f"the dice_fast C++ extension did not build or load: {type(e).__name__}: {e}"
    return True, ""


def _require(device: torch.device) -> None:
    if not is_loaded():
        raise RuntimeError("the dice_fast C++ extension (dice_fast_C) is not built in this process. " + _HOW_TO)
    if device.type == "cuda" and not has_cuda_kernels():
        raise RuntimeError(
            "the dice_fast C++ extension was built without CUDA kernels; build(with_cuda=True) in a fresh "
            "process (needs nvcc), or use impl='triton' / impl='torch' for CUDA tensors"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the dice_fast C++ extension has kernels for cpu and cuda tensors, not {device.type}")


# --------------------------------------------------------------------------------------------
# ops: csrc/register.cpp defines them with the schema strings of spec.SCHEMAS
# --------------------------------------------------------------------------------------------
def pool_chunks_native(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """Token states -> one vector per chunk, in C++ (CPU) or CUDA C++ (``dice_fast_C::pool_chunks``).

    hidden: (total_tokens, hidden_size) float32/bf16/fp16; cu_seqlens: (n_chunks + 1,) int32 on
    hidden's device. Returns (n_chunks, hidden_size) float32. ``pooling``: mean | cls | last.
    """
    check_pool_chunks_inputs(hidden, cu_seqlens, pooling)
    _require(hidden.device)
    return torch.ops.dice_fast_C.pool_chunks(hidden, cu_seqlens, pooling)


def aggregate_documents_native(
    chunks: torch.Tensor,
    cu_doc_chunks: torch.Tensor,
    chunk_weights: torch.Tensor | None = None,
    aggregation: str = "mean",
    top_k: int = 1,
    temperature: float = 1.0,
    normalize_chunks: bool = False,
    normalize: bool = True,
) -> torch.Tensor:
    """Chunk vectors -> one vector per document, in C++ (CPU) or CUDA C++ (``dice_fast_C::aggregate_documents``).

    chunks: (n_chunks, hidden_size) float32; cu_doc_chunks: (n_docs + 1,) int64; chunk_weights:
    (n_chunks,) float32 or None. Returns (n_docs, hidden_size) float32.
    """
    check_aggregate_inputs(chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature)
    _require(chunks.device)
    return torch.ops.dice_fast_C.aggregate_documents(
        chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature, normalize_chunks, normalize
    )
