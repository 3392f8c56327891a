"""Options resolved once: a `DiceConfig` plus the loaded model's facts become the frozen `Settings`
that every stage reads (planning, the queue, the runner, the cache namespace).

    settings = resolve(config, spec, tokenizer, device, dtype)   # raises OptionError on what cannot work
    settings.window, settings.config.chunk_size, settings.max_batch_tokens   # never None
    settings.chunking("documents")                                           # how a text is cut

Every default that depends on the model or the device is settled here, and only here: the window
(the model's), the chunk size (256, or what fits the window), the pooling and chunk normalisation
(the model's sentence-transformers config), the token budget of a batch, the attention backend, the
device and dtype (`placement`, `pretrained_placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .attention import choose_backend
from .config import DEFAULT_CHUNK_SIZE, DiceConfig
from .errors import OptionError
from .matryoshka import check_dim
from .models import ModelSpec
from .ops import resolve_impl

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the torch dtype of the model's weights per dtype option: "int8" keeps the float32 model (dice_fast.quant
# exports and quantizes it), "auto" loads float32 before dice_fast.cpu_paths chooses
WEIGHT_DTYPES = {**TORCH_DTYPES, "int8": torch.float32, "auto": torch.float32}
# token budget of one packed forward when max_batch_tokens is None (why 4096 on a CPU: benchmarks/RESULTS.md,
# "Figures moved out of docstrings (issue 23)")
DEFAULT_BATCH_TOKENS = {"cpu": 4096, "cuda": 65536}
# int8 (CPU): a batch's sub-batches run one per OpenVINO stream; 8192 gives each of 2 streams 16 chunks of
# 256 tokens and halves the batch barriers (1.05-1.4x 4096 on the loaded 2-core Zen 4, RESULTS §13)
INT8_BATCH_TOKENS = 8192
OTHER_DEVICE_BATCH_TOKENS = 16384
_CAUSAL = {"model default": None, "causal": True, "bidirectional": False}


class Chunking(NamedTuple):
    """How a text of one kind is cut: ``wrap`` (prefix ids, suffix ids) around every chunk, ``size``
    text tokens per chunk, ``overlap``, ``cap`` chunks kept per text (None: all), ``global_positions``."""

    wrap: tuple[np.ndarray, np.ndarray]
    size: int
    overlap: int
    cap: int | None
    global_positions: bool


@dataclass(frozen=True, eq=False)
class Settings:
    """Everything the engine's stages read, resolved (no ``None`` left to interpret).

    config: the `DiceConfig` with ``chunk_size`` filled in. spec: the model's `ModelSpec`.
    device / dtype: where the model runs. window: tokens of a model window, specials included.
    document_wrap / query_wrap: (prefix ids, suffix ids) around every chunk / query: the model's
    special tokens with the document / query prefix's ids. pooling: token -> chunk. normalize_chunks:
    chunk vectors are L2-normalised before aggregating. causal: None (the model's own), True or False.
    max_batch_tokens: token budget of one forward. backend: the attention backend asked of the runner.
    pooling_impl: the pooling/aggregation kernels ("torch", "triton", "native", "reference").
    """

    config: DiceConfig
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    window: int
    document_wrap: tuple[np.ndarray, np.ndarray]
    query_wrap: tuple[np.ndarray, np.ndarray]
    pooling: str
    normalize_chunks: bool
    causal: bool | None
    max_batch_tokens: int
    backend: str
    pooling_impl: str

    @property
    def dim(self) -> int:
        """Width of the returned vectors: ``truncate_dim``, else the model's hidden size."""
        return self.config.truncate_dim or self.spec.hidden_size

    @property
    def chunk_overhead(self) -> int:
        """Tokens every document chunk carries besides its text (special tokens and document prefix)."""
        return _overhead(self.document_wrap)

    @property
    def is_causal(self) -> bool:
        """Whether chunks are attended causally (the option, else the model's own attention)."""
        return self.spec.is_causal if self.causal is None else self.causal

    def chunking(self, kind: str) -> Chunking:
        """How a text of ``kind`` ("documents" or "queries") is cut into chunks."""
        c = self.config
        if kind == "queries":
            wrap, size, overlap, cap, global_positions = self.query_wrap, None, 0, 1, False
        elif c.strategy == "single":
            wrap, size, overlap, cap, global_positions = self.document_wrap, None, 0, 1, False
        else:
            wrap, size, overlap = self.document_wrap, c.chunk_size, c.overlap
            cap, global_positions = c.max_chunks_per_document, c.positions == "global"
        if size is None:
            size = self.window - _overhead(wrap)
        return Chunking(wrap, size, overlap, cap, global_positions)


def resolve(config: DiceConfig, spec: ModelSpec, tokenizer, device: torch.device, dtype: torch.dtype) -> Settings:
    """`Settings` of ``config`` for a model (``spec``, ``tokenizer``) placed on ``device`` in ``dtype``.

    Raises `OptionError` naming the option when the model cannot take it (a window or chunk over its
    positions, a truncate_dim over its width, an attention backend missing on the device)."""
    cfg = config
    pooling_impl = resolve_impl(cfg.pooling_impl, device)
    window = cfg.max_length if cfg.max_length is not None else spec.window
    if window > spec.position_limit:
        raise OptionError(f"max_length {window} exceeds the model's {spec.position_limit} positions")
    specials = len(spec.special_prefix) + len(spec.special_suffix)
    doc_wrap = _wrap_ids(tokenizer, spec, cfg.document_prefix)
    query_wrap = _wrap_ids(tokenizer, spec, cfg.query_prefix)
    doc_overhead = specials + len(doc_wrap[0]) - len(spec.special_prefix)
    if window - doc_overhead < 1:
        raise OptionError(f"the model window of {window} tokens leaves no room for text beside {doc_overhead} "
                          "special/prefix tokens")
    if cfg.chunk_size is None:
        size = min(DEFAULT_CHUNK_SIZE, window - doc_overhead)
        if cfg.overlap >= size:
            raise OptionError(f"overlap ({cfg.overlap}) must be smaller than the default chunk_size ({size}) of "
                              "this model; allowed: 0 <= overlap < chunk_size")
        cfg = cfg.replace(chunk_size=size)
    if cfg.chunk_size + doc_overhead > spec.position_limit:
        raise OptionError(
            f"chunk_size {cfg.chunk_size} plus {doc_overhead} special/prefix tokens is "
            f"{cfg.chunk_size + doc_overhead} tokens, more than the model's {spec.position_limit} "
            f"positions; allowed: chunk_size <= {spec.position_limit - doc_overhead}"
        )
    check_dim(cfg.truncate_dim, spec.hidden_size)
    return Settings(
        config=cfg, spec=spec, device=device, dtype=dtype, window=window, document_wrap=doc_wrap,
        query_wrap=query_wrap, pooling=cfg.pooling or spec.pooling,
        normalize_chunks=spec.normalizes if cfg.normalize_chunks is None else cfg.normalize_chunks,
        causal=_CAUSAL[cfg.attention],
        max_batch_tokens=cfg.max_batch_tokens or (INT8_BATCH_TOKENS if cfg.dtype == "int8" else
                                                  DEFAULT_BATCH_TOKENS.get(device.type, OTHER_DEVICE_BATCH_TOKENS)),
        backend=choose_backend(cfg.attention_backend, device, dtype), pooling_impl=pooling_impl,
    )


def placement(config: DiceConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    """Where a model now on ``device`` in ``dtype`` runs under ``config`` (``None`` options: where it is)."""
    return (torch.device(config.device) if config.device is not None else device,
            WEIGHT_DTYPES[config.dtype] if config.dtype is not None else dtype)


def pretrained_placement(device=None, dtype=None) -> tuple[torch.device, str]:
    """(device, dtype name) of a model to load: CUDA with bfloat16 when available, else CPU with float32;
    a given ``device`` / ``dtype`` (a name or a ``torch.dtype``) is kept."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = str(dtype or ("bfloat16" if device.type == "cuda" else "float32")).replace("torch.", "")
    if dtype not in WEIGHT_DTYPES:
        raise OptionError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    return device, dtype


def _wrap_ids(tokenizer, spec: ModelSpec, text_prefix: str) -> tuple[np.ndarray, np.ndarray]:
    ids = tokenizer(text_prefix, add_special_tokens=False)["input_ids"] if text_prefix else []
    prefix = np.asarray(list(spec.special_prefix) + list(ids), dtype=np.int64)
    return prefix, np.asarray(spec.special_suffix, dtype=np.int64)


def _overhead(wrap) -> int:
    return len(wrap[0]) + len(wrap[1])


__all__ = ["Chunking", "TORCH_DTYPES", "WEIGHT_DTYPES", "DEFAULT_BATCH_TOKENS", "Settings", "placement", "pretrained_placement", "resolve"]
