"""Options of a `DiceEncoder`, validated once when the encoder is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .ops.spec import AGGREGATIONS, POOLINGS, check_aggregation, check_pooling

STRATEGIES = ("dice", "single")
POSITIONS = ("local", "global")
ATTENTION_MODES = ("model default", "causal", "bidirectional")
ATTENTION_BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa_groups", "padded")
DEFAULT_CHUNK_SIZE = 256
# int8: static int8 on the CPU (dice_fast.quant), the float32 model kept for its facts and export
DTYPES = ("float32", "bfloat16", "float16", "int8")


@dataclass(frozen=True)
class DiceConfig:
    """Every option of the engine. See README.md ("Options") for the table.

    chunk_size: tokens of document text per chunk (specials and prefix come on top); ``None`` means
        ``min(256, what fits the model's window beside the specials and prefix)``.
    overlap: tokens shared by consecutive chunks (paper default 0); must be < chunk_size.
    positions: "local" (restart at the model's first position in every chunk: DICE) or "global"
        (the chunk's offset in the document: the paper's ablation).
    pooling: token -> chunk, "mean" | "cls" | "last"; ``None`` reads the model's
        sentence-transformers config, else "mean".
    aggregation: chunk -> document, "mean" | "weighted_mean" | "max" | "topk_norm" | "softmax_norm".
    top_k: chunks kept by "topk_norm". temperature: of "softmax_norm".
    normalize_chunks: L2-normalise chunk vectors before aggregating (``None``: True when the model
        ends in a sentence-transformers Normalize module, so chunk vectors match that model's output).
        Settled by the ablation in benchmarks/RESULTS.md §5.3 (all-MiniLM-L6-v2, passkey + needle,
        chunk sizes 64/128/254, 256 to 32k tokens): normalised chunks won 111 (task, length) cells
        of Hit@1 against 34 for raw ones (95 tied), mean +1.9 points, and +20 / +10 points for
        ``mean`` at chunk size 254 on passkey / needle: otherwise a chunk's pooled norm weights it.
    normalize: L2-normalise the returned document and query vectors.
    truncate_dim: keep the first N components of document, query and chunk vectors (Matryoshka;
        sentence-transformers' name), re-normalised when those vectors are normalised (documents and
        queries: ``normalize``; chunks: ``normalize_chunks``); aggregation runs on the full chunk
        vectors. ``None``: the model's width. Must be <= the model's width.
    strategy: "dice" or "single" (the single-vector baseline: one window of the first
        ``max_length`` tokens).
    attention: "model default" | "causal" | "bidirectional".
    attention_backend: "auto" | "flash_attn" | "torch_varlen" | "sdpa_groups" | "padded" (the exact
        fallback: dense padded batches with the model's own attention; chosen by "auto" for models
        whose attention cannot run packed).
    document_prefix / query_prefix: text placed after the special prefix of every chunk / query.
    max_chunks_per_document: keep only the first N chunks of each document (``None``: all).
    max_length: the model window in tokens including specials (``None``: the sentence-transformers
        ``max_seq_length``, else the tokenizer's ``model_max_length``, else the position table).
    max_batch_tokens: token budget of one packed forward (``None``: 4096 on CPU, 65536 on CUDA).
    device, dtype: where and in which precision the model runs (``None``: CUDA if available with
        bfloat16, else CPU with float32). ``dtype="int8"``: static int8 on the CPU (OpenVINO + NNCF,
        the ``int8`` extra; CPUs with VNNI or AMX): not exact, its agreement with float32 is stated in
        docs/int8.md and checked by `dice_fast.quant.agreement`.
    calibration: ``dtype="int8"`` only: a UTF-8 text file, a sample of the user's corpus, whose chunks
        calibrate the int8 model (``None``: the first half of the bundled prose).
    pooling_impl: "auto" | "torch" | "triton" | "native" | "reference" (see `dice_fast.ops`).
    """

    chunk_size: int | None = None
    overlap: int = 0
    positions: str = "local"
    pooling: str | None = None
    aggregation: str = "mean"
    top_k: int = 2
    temperature: float = 1.0
    normalize_chunks: bool | None = None
    normalize: bool = True
    truncate_dim: int | None = None
    strategy: str = "dice"
    attention: str = "model default"
    attention_backend: str = "auto"
    document_prefix: str = ""
    query_prefix: str = ""
    max_chunks_per_document: int | None = None
    max_length: int | None = None
    max_batch_tokens: int | None = None
    device: str | None = None
    dtype: str | None = None
    pooling_impl: str = "auto"
    calibration: str | None = None

    def __post_init__(self):
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("positions", self.positions, POSITIONS)
        _choice("attention", self.attention, ATTENTION_MODES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.pooling is not None:
            check_pooling(self.pooling)
        check_aggregation(self.aggregation, self.top_k, self.temperature)
        if self.aggregation != "topk_norm":
            _positive_int("top_k", self.top_k)
        _positive_int("chunk_size", self.chunk_size, optional=True)
        _positive_int("truncate_dim", self.truncate_dim, optional=True)
        _positive_int("max_chunks_per_document", self.max_chunks_per_document, optional=True)
        _positive_int("max_length", self.max_length, optional=True)
        _positive_int("max_batch_tokens", self.max_batch_tokens, optional=True)
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, int) or self.overlap < 0:
            raise ValueError(f"overlap must be an integer >= 0, got {self.overlap!r}")
        if self.chunk_size is not None and self.overlap >= self.chunk_size:
            raise ValueError(
                f"overlap ({self.overlap}) must be smaller than chunk_size ({self.chunk_size}); "
                "allowed: 0 <= overlap < chunk_size"
            )
        for name in ("document_prefix", "query_prefix"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        for name in ("normalize", "normalize_chunks"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and name == "normalize_chunks")):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.calibration is not None and (self.dtype != "int8" or not isinstance(self.calibration, str)):
            raise ValueError(f"calibration (a text file path) applies to dtype='int8' only; got "
                             f"calibration={self.calibration!r} with dtype={self.dtype!r}")
        from .ops import IMPLS

        _choice("pooling_impl", self.pooling_impl, IMPLS)

    def replace(self, **changes) -> DiceConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(map(repr, allowed))}")


def _positive_int(name: str, value, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1{' or None' if optional else ''}, got {value!r}")


__all__ = ["DiceConfig", "STRATEGIES", "POSITIONS", "ATTENTION_MODES", "ATTENTION_BACKENDS", "POOLINGS", "AGGREGATIONS"]
