"""OpenVINO on the CPU behind the engine's plan, pack, pool and aggregate: int8 (static quantization
with calibration on text) and the float precisions (``runtime="openvino"``).

    enc = DiceEncoder.from_pretrained(dtype="int8")              # calibrated on the bundled prose
    enc = DiceEncoder.from_pretrained(dtype="int8", calibration="sample_of_my_corpus.txt")
    enc = DiceEncoder.from_pretrained(dtype="bfloat16", runtime="openvino")   # OpenVINO's fused bf16 graph
    agreement(enc, DiceEncoder.from_pretrained())                 # cos min / mean vs float32, held-out prose

Needs the ``int8`` extra (``pip install dice-fast[int8]``: OpenVINO and NNCF); int8 a CPU with int8
dot-product instructions (`check_int8_cpu`), bfloat16 one with bf16 units. Not exact: agreement with
float32 is measured and stated (docs/int8.md, docs/cpu.md). Importing this package loads neither
OpenVINO nor NNCF.
"""

from __future__ import annotations

import torch

from ..config import dtype_name
from ..errors import MissingDependency, OptionError
from .agreement import Agreement, agreement, cosines, held_out_texts
from .cpu import Int8Unsupported, check_int8_cpu, int8_dot_instructions

__all__ = ["Agreement", "agreement", "cosines", "held_out_texts", "Int8Unsupported", "check_int8_cpu",
           "int8_dot_instructions", "openvino_runner"]


def openvino_runner(encoder, model, pad_token_id, streams: int | None = None, hints: dict | None = None):
    """The `OpenVinoRunner` of a `DiceEncoder` being built (its tokenizer, spec, window and wrapping are
    set) for its dtype: int8 (calibration chunks from ``encoder.config.calibration``, None: the bundled
    prose), float32 or bfloat16 (the model exported unquantized); the exported model cached beside the
    CPU tuning cache (``$DICE_FAST_CACHE_DIR``). ``streams`` as for `OpenVinoRunner`; ``hints``: extra
    int8 compile properties (benchmarks swap a built encoder's runner with them)."""
    from ..cpu_tuning import cache_path
    from ..cpu_paths import bf16_units
    from ..reuse.keys import model_fingerprint
    from .openvino import FLOAT_PRECISIONS
    from .runner import OpenVinoRunner

    cfg = encoder.config
    int8 = cfg.dtype == "int8"
    # the precision OpenVINO runs: the dtype option (the torch weights stay float32, `weight_dtype`), else
    # the model's own
    dtype = cfg.dtype or dtype_name(encoder.dtype)
    if not int8 and dtype not in FLOAT_PRECISIONS:
        raise OptionError(f"runtime='openvino' runs dtype float32, bfloat16 or int8, not {dtype!r}")
    if dtype == "bfloat16" and bf16_units() is not None:
        raise OptionError(f"runtime='openvino' with dtype='bfloat16' needs bf16 units: {bf16_units()} (OpenVINO "
                          "would run float32 or emulated bf16); use dtype='float32'")
    if int8:
        check_int8_cpu()  # before any export or calibration work
    try:
        import openvino  # noqa: F401
        if int8:
            import nncf  # noqa: F401
    except ImportError as exc:
        what = "dtype='int8' needs OpenVINO and NNCF" if int8 else "runtime='openvino' needs OpenVINO"
        raise MissingDependency(f"{what}: pip install 'dice-fast[int8]'") from exc
    from . import openvino as ovq

    # the fixed-length twin's width: a full document chunk's wrapped length (late chunking: a full window's)
    cut = encoder.settings.chunking("documents")
    full_chunk = (cut.late[0] if cut.late is not None else cut.size) + encoder.chunk_overhead
    root, fingerprint, threads = cache_path().parent, model_fingerprint(model), torch.get_num_threads()
    if int8:
        chunks = _calibration(encoder)

        def build(takes_positions, n_streams):
            return ovq.int8_model(model, chunks, root, fingerprint, takes_positions, threads, n_streams, hints,
                                  full_chunk)
    else:
        def build(takes_positions, n_streams):
            return ovq.float_model(model, dtype, root, fingerprint, takes_positions, threads, n_streams, full_chunk)
    return OpenVinoRunner(model, encoder.spec, encoder.pooling, encoder.pooling_impl, encoder.max_batch_tokens,
                          pad_token_id, build, streams)


def _calibration(encoder):
    """The int8 calibration chunks of ``encoder``: windows of the default chunk size whatever chunk_size
    is (encoders differing only in their chunking, the evaluation's twins, share one quantized model)."""
    from ..config import DEFAULT_CHUNK_SIZE
    from .calibration import calibration_chunks, calibration_text

    prefix, suffix = encoder.settings.document_wrap
    size = min(DEFAULT_CHUNK_SIZE, encoder.window - encoder.chunk_overhead)
    path = encoder.config.calibration
    return calibration_chunks(encoder.tokenizer, calibration_text(path), size, prefix, suffix,
                              encoder.spec.first_position, source=repr(path) if path else "the bundled prose")
