"""Does this CPU have int8 dot-product instructions? The int8 path runs only where it has.

int8 GEMMs are fast only with a dot-product instruction that multiplies int8 pairs and accumulates
in int32 in one step: AVX-512 VNNI (Cascade Lake+, Zen 4+), AVX-VNNI (Alder Lake+, Zen 5) or AMX
(Sapphire Rapids+). Without one (an AVX2-only Zen 3, say) int8 runs through multi-instruction
emulation with an int16 intermediate; measured on a Zen 3 (benchmarks/RESULTS.md §18) it ran 0.75x the
float32 OpenVINO path at cos min 0.985 (0.995 with VNNI), so it is refused there (set
``DICE_FAST_INT8_ANY_CPU=1`` to run it anyway, with a warning).

Also here, the other thing of the process an OpenVINO export needs: TorchScript on (`tracing_off`).
"""

from __future__ import annotations

import os
import warnings

from .. import cpu_tuning

from ..errors import Int8Unsupported

INT8_DOT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
ENV_ANY_CPU = "DICE_FAST_INT8_ANY_CPU"


def int8_dot_instructions(flags: set[str] | None = None) -> tuple[str, ...]:
    """The int8 dot-product instruction sets among ``flags`` (None: this CPU's), best first."""
    flags = cpu_tuning.cpu_flags() if flags is None else flags  # looked up per call (tests patch it)
    return tuple(f for f in INT8_DOT_FLAGS if f in flags)


def check_int8_cpu(flags: set[str] | None = None) -> tuple[str, ...]:
    """The int8 instructions the path will use; raises `Int8Unsupported` where there are none
    (unless ``$DICE_FAST_INT8_ANY_CPU`` is 1, which warns instead)."""
    found = int8_dot_instructions(flags)
    if found:
        return found
    msg = (f"dtype='int8' needs a CPU with int8 dot-product instructions ({', '.join(INT8_DOT_FLAGS)}); "
           "this CPU has none, so int8 would run emulated: slower than float32 on OpenVINO and further from "
           "float32 (measured on an AVX2-only Zen 3: 0.75x, cos min 0.985). "
           "Use dtype='auto' (the fastest path this CPU has and meets the agreement bound; on an "
           "AVX2-only CPU float32 with runtime='openvino') or dtype='float32'")
    if os.environ.get(ENV_ANY_CPU) == "1":
        warnings.warn(msg + f" ({ENV_ANY_CPU}=1: running int8 anyway)", stacklevel=3)
        return ()
    raise Int8Unsupported(msg + f", or set {ENV_ANY_CPU}=1 to run it anyway")


def tracing_off() -> str | None:
    """Why no model can be exported to OpenVINO in this process, or None: the export traces the model
    with TorchScript, which ``PYTORCH_JIT=0`` (or false / no, as torch reads it) turns off; the trace
    then fails deep in OpenVINO's decoder."""
    if os.environ.get("PYTORCH_JIT", "1").lower() not in ("0", "false", "no", "0v"):
        return None
    return (f"OpenVINO's export traces the model with TorchScript, which PYTORCH_JIT={os.environ['PYTORCH_JIT']} "
            "turns off in this process (unset it; a model exported before is read from the cache without tracing)")
