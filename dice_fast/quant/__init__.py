"""int8 on the CPU: static quantization with calibration on text, behind the engine's plan, pack, pool
and aggregate (``DiceEncoder.from_pretrained(dtype="int8")``).

    enc = DiceEncoder.from_pretrained(dtype="int8")              # calibrated on the bundled prose
    enc = DiceEncoder.from_pretrained(dtype="int8", calibration="sample_of_my_corpus.txt")
    agreement(enc, DiceEncoder.from_pretrained())                 # cos min / mean vs float32, held-out prose

Needs the ``int8`` extra (``pip install dice-fast[int8]``: OpenVINO and NNCF) and a CPU with int8
dot-product instructions (`check_int8_cpu`). Not exact: its agreement with float32 is measured and
stated (docs/int8.md). Importing this package loads neither OpenVINO nor NNCF.
"""

from __future__ import annotations

from .agreement import Agreement, agreement, cosines, held_out_texts
from .cpu import Int8Unsupported, check_int8_cpu, int8_dot_instructions
from ..errors import MissingDependency, OptionError

__all__ = ["Agreement", "agreement", "cosines", "held_out_texts", "Int8Unsupported", "check_int8_cpu",
           "int8_dot_instructions", "int8_runner"]


def int8_runner(encoder, model, pad_token_id, streams: int | None = None, hints: dict | None = None):
    """The `Int8Runner` of a `DiceEncoder` being built (its tokenizer, spec, window and wrapping are
    set): calibration chunks from ``encoder.config.calibration`` (None: the bundled prose), the
    quantized model cached beside the CPU tuning cache (``$DICE_FAST_CACHE_DIR``). ``streams`` and
    ``hints`` as for `Int8Runner` (benchmarks swap a built encoder's runner with them)."""
    try:
        import nncf  # noqa: F401
        import openvino  # noqa: F401
    except ImportError as exc:
        raise MissingDependency("dtype='int8' needs OpenVINO and NNCF: pip install 'dice-fast[int8]'") from exc
    from ..reuse.persistent import model_fingerprint
    from ..config import DEFAULT_CHUNK_SIZE
    from ..cpu_attention import cache_path
    from .calibration import calibration_chunks, calibration_text
    from .runner import Int8Runner

    if encoder.device.type != "cpu":
        raise OptionError(f"dtype='int8' runs on the CPU only; got device {encoder.device}")
    check_int8_cpu()  # before any export or calibration work
    prefix, suffix = encoder.settings.document_wrap
    # windows of the default chunk size whatever chunk_size is: encoders differing only in their
    # chunking (the evaluation's twins) share one quantized model
    size = min(DEFAULT_CHUNK_SIZE, encoder.window - encoder.chunk_overhead)
    chunks = calibration_chunks(encoder.tokenizer, calibration_text(encoder.config.calibration), size, prefix,
                                suffix, encoder.spec.first_position)
    # a full document chunk's length: the fixed-length twin's (late chunking never runs on int8)
    strategy = "single" if encoder.config.strategy == "single" else "dice"
    full_chunk = encoder.settings.chunking("documents", strategy).size + encoder.chunk_overhead
    return Int8Runner(model, encoder.spec, encoder.pooling, encoder.pooling_impl, encoder.max_batch_tokens,
                      pad_token_id, chunks, cache_path().parent, model_fingerprint(model), streams, hints, full_chunk)
