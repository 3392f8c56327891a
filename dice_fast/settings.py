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

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .attention import choose_backend
from .config import DEFAULT_CHUNK_SIZE, STRATEGIES, DiceConfig, dtype_name
from .cpu_tuning import float32_matmuls, has_amx_bf16
from .errors import OptionError
from .head import ChunkHead, load_head
from .matryoshka import check_dim
from .models import ModelSpec
from .ops import resolve_impl, unavailable
from .text_prefix import TextPrefix

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the torch dtype of the model's weights per dtype option: "int8" keeps the float32 model (dice_fast.quant
# exports and quantizes it), "auto" loads float32 before dice_fast.cpu_paths chooses
WEIGHT_DTYPES = {**TORCH_DTYPES, "int8": torch.float32, "auto": torch.float32}
# token budget of one packed forward when max_batch_tokens is None (why 4096 on a CPU: benchmarks/RESULTS.md,
# "Figures moved out of docstrings (issue 23)")
DEFAULT_BATCH_TOKENS = {"cpu": 4096, "cuda": 65536}
# bf16 on a CPU with AMX (fp16 not measured): its tile GEMMs and dice_fast's AMX attention leave each forward's fixed
# cost (Python, per-op dispatch) a larger share, which 8192 halves: MiniLM on the 2-core AMX Xeon, 500
# texts of 254 tokens, 8 interleaved rounds, 42,950 against 40,525 tokens/s, every round ahead (float32
# is slower there at 8192: 9,217 against 10,227; RESULTS §20)
AMX_BF16_BATCH_TOKENS = 8192
# the OpenVINO runtime (int8, float; CPU): a batch's sub-batches run one per OpenVINO stream; 8192 gives each of 2 streams 16 chunks of
# 256 tokens and halves the batch barriers (1.05-1.4x 4096 on the loaded 2-core Zen 4, RESULTS §15)
OPENVINO_BATCH_TOKENS = 8192
OTHER_DEVICE_BATCH_TOKENS = 16384
# CUDA: a default batch carries about CUDA_BATCH_FLOP of work (~20 ms at the H200's 790 TFLOP/s bf16),
# so its fixed costs (launches, host packing) are a small share: the next power of two of tokens, within
# CUDA_BATCH_TOKENS. Projected, not measured (benchmarks/RESULTS.md §13): MiniLM-L6 (21 MFLOP/token) gets
# 524,288 tokens, BERT-base (170 MFLOP) 131,072, anything from ~0.25 GFLOP per token 65,536.
CUDA_BATCH_FLOP = 16e12
CUDA_BATCH_TOKENS = (65536, 524288)
_CAUSAL = {"model default": None, "causal": True, "bidirectional": False}


class Chunking(NamedTuple):
    """How a text of one kind is cut: ``wrap`` (prefix ids, suffix ids) around every chunk, ``size``
    text tokens per chunk, ``overlap``, ``cap`` chunks kept per text (None: all), ``global_positions``,
    ``late`` (window capacity in text tokens, window overlap) for late chunking, else None, ``unpooled``
    leading tokens of every wrapped chunk its pooling leaves out (the prompt, `Settings.unpooled`)."""

    wrap: tuple[np.ndarray, np.ndarray]
    size: int
    overlap: int
    cap: int | None
    global_positions: bool
    late: tuple[int, int] | None = None
    unpooled: int = 0


LATE_MAX_WINDOW = 8192  # the default window of late chunking is the position table, at most this
LATE_DEFAULT_OVERLAP = 128


@dataclass(frozen=True, eq=False)
class Settings:
    """Everything the engine's stages read, resolved (no ``None`` left to interpret).

    config: the `DiceConfig` with ``chunk_size`` filled in. spec: the model's `ModelSpec`.
    device / dtype: where the model runs. window: tokens of a model window, specials included.
    document_wrap / query_wrap: (prefix ids, suffix ids) around every chunk / query: the model's
    special tokens with the document / query prefix's ids. document_text_prefix / query_text_prefix: the
    `TextPrefix` texts of that kind are tokenized after (None: none). pooling: token -> chunk. normalize_chunks:
    chunk vectors are L2-normalised before aggregating. causal: None (the model's own), True or False.
    max_batch_tokens: token budget of one forward. backend: the attention backend asked of the runner.
    pooling_impl: the pooling/aggregation kernels ("torch", "triton", "native", "reference").
    pipeline: batches are prepared in a producer thread (`dice_fast.pipeline`).
    head: the model's Dense, LayerNorm and Normalize modules after its pooling, run on every chunk
    vector (`dice_fast.head`), or None. leaves_prompt_out: the model's Pooling leaves a prompt's tokens
    out (include_prompt false) of a mean or cls pooling.
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
    pipeline: bool = False
    document_text_prefix: TextPrefix | None = None
    query_text_prefix: TextPrefix | None = None
    head: ChunkHead | None = None
    leaves_prompt_out: bool = False

    def text_prefix(self, kind: str | None) -> TextPrefix | None:
        """The `TextPrefix` texts of ``kind`` ("documents", "queries"; None: none) follow, or None."""
        return {"documents": self.document_text_prefix, "queries": self.query_text_prefix}.get(kind)

    def unpooled(self, kind: str) -> int:
        """Leading tokens of every wrapped chunk of ``kind`` its pooling leaves out: the prefix's
        sentence-transformers ``prompt_length`` where the model's Pooling leaves the prompt out, else 0."""
        prefix = self.text_prefix(kind)
        return prefix.prompt_length if self.leaves_prompt_out and prefix is not None else 0

    @property
    def chunk_dim(self) -> int:
        """Width of a chunk vector: the head's output, else the model's hidden size."""
        return self.head.out_features if self.head is not None else self.spec.hidden_size

    @property
    def dim(self) -> int:
        """Width of the returned vectors: ``truncate_dim``, else `chunk_dim`."""
        return self.config.truncate_dim or self.chunk_dim

    @property
    def chunk_overhead(self) -> int:
        """Tokens every document chunk carries besides its text (special tokens and document prefix)."""
        return _overhead(self.document_wrap)

    @property
    def is_causal(self) -> bool:
        """Whether chunks are attended causally (the option, else the model's own attention)."""
        return self.spec.is_causal if self.causal is None else self.causal

    def chunking(self, kind: str, strategy: str | None = None) -> Chunking:
        """How a text of ``kind`` ("documents" or "queries") is cut into chunks under ``strategy`` (one of
        `STRATEGIES`; None: the configured one). Raises `OptionError` naming the option for a strategy
        the options cannot take (`late_windows`)."""
        c = self.config
        strategy = c.strategy if strategy is None else check_strategy(strategy)
        late = None
        if kind == "queries":
            wrap, size, overlap, cap, global_positions = self.query_wrap, None, 0, 1, False
        elif strategy == "single":
            wrap, size, overlap, cap, global_positions = self.document_wrap, None, 0, 1, False
        else:
            wrap, size, overlap = self.document_wrap, c.chunk_size, c.overlap
            cap, global_positions = c.max_chunks_per_document, c.positions == "global"
            late = self.late_windows() if strategy == "late" else None
        if size is None:
            size = self.window - _overhead(wrap)
        return Chunking(wrap, size, overlap, cap, global_positions, late, self.unpooled(kind))

    def pooling_label(self) -> str:
        """"mean", or "mean (prompt left out)" where the model's Pooling leaves a prefix's tokens out."""
        return self.pooling + (" (prompt left out)" if self.leaves_prompt_out else "")

    def head_label(self) -> str:
        """", head=[Dense 768->768 Tanh]": the model's modules on the pooled vector, else ""."""
        return "" if self.head is None else f", head={self.head!r}"

    def late_label(self) -> str:
        """", window_tokens=512, window_overlap=127": the windows late chunking runs (strategy late), else ""."""
        if self.config.strategy != "late":
            return ""
        capacity, overlap = self.late_windows()
        return f", window_tokens={capacity + self.chunk_overhead}, window_overlap={overlap}"

    def late_windows(self) -> tuple[int, int]:
        """(text tokens a late-chunking window holds, tokens consecutive windows share), or `OptionError`
        naming the option that late chunking cannot take."""
        c, spec = self.config, self.spec
        tokens = c.window_tokens if c.window_tokens is not None else min(spec.position_limit, LATE_MAX_WINDOW)
        if tokens > spec.position_limit:
            raise OptionError(f"window_tokens {tokens} exceeds the model's {spec.position_limit} positions")
        if self.pooling != "mean":
            raise OptionError(f"strategy='late' pools each chunk's own tokens by their mean; pooling={self.pooling!r} "
                              "(a window has one first and one last token, not one per chunk) cannot; use pooling='mean'")
        if c.overlap:
            raise OptionError(f"strategy='late' pools disjoint chunks; overlap must be 0, got {c.overlap} (context "
                              "between windows is window_overlap)")
        if c.positions != "local":
            raise OptionError("strategy='late' restarts positions in every window; positions must be 'local'")
        capacity = tokens - self.chunk_overhead
        room = capacity - c.chunk_size
        if room < 0:
            raise OptionError(f"window_tokens {tokens} holds {capacity} text tokens beside {self.chunk_overhead} special/"
                              f"prefix tokens, less than chunk_size {c.chunk_size}; allowed: window_tokens >= "
                              f"{c.chunk_size + self.chunk_overhead}")
        overlap = min(LATE_DEFAULT_OVERLAP, capacity // 4, room) if c.window_overlap is None else c.window_overlap
        if overlap > room:
            raise OptionError(f"window_overlap {overlap} does not fit a window of {capacity} text tokens beside one chunk "
                              f"of {c.chunk_size}; allowed: window_overlap <= {room}")
        return capacity, overlap


def resolve(config: DiceConfig, spec: ModelSpec, tokenizer, device: torch.device, dtype: torch.dtype) -> Settings:
    """`Settings` of ``config`` for a model (``spec``, ``tokenizer``) placed on ``device`` in ``dtype``.

    Raises `OptionError` naming the option when the model cannot take it (a window or chunk over its
    positions, a truncate_dim over its width, an attention backend missing on the device)."""
    cfg = config
    pooling_impl = resolve_impl(cfg.pooling_impl, device)
    why = unavailable(pooling_impl, device)
    if why:
        raise OptionError(f"pooling_impl={cfg.pooling_impl!r} cannot run on {device}: {why}; or use "
                          "pooling_impl='auto'")
    window = cfg.max_length if cfg.max_length is not None else spec.window
    if window > spec.position_limit:
        raise OptionError(f"max_length {window} exceeds the model's {spec.position_limit} positions")
    cfg = cfg.replace(  # None: the model's saved prompt (what sentence-transformers' encode_document / _query apply)
        document_prefix=spec.document_prompt if cfg.document_prefix is None else cfg.document_prefix,
        query_prefix=spec.query_prompt if cfg.query_prefix is None else cfg.query_prefix)
    doc_text, query_text = (TextPrefix.of(tokenizer, text) for text in (cfg.document_prefix, cfg.query_prefix))
    doc_wrap, query_wrap = _wrap_ids(spec, doc_text), _wrap_ids(spec, query_text)
    doc_overhead = _overhead(doc_wrap)
    for name, wrap in (("document_prefix", doc_wrap), ("query_prefix", query_wrap)):
        if spec.vocab_size and any(int(i) >= spec.vocab_size for i in (*wrap[0], *wrap[1])):
            raise OptionError(f"{name} (or the special tokens around it) holds a token id beyond the model's "
                              f"{spec.vocab_size} embeddings: the tokenizer has tokens the model was not resized for")
        overhead = _overhead(wrap)
        if window - overhead < 1:
            raise OptionError(f"the model window of {window} tokens (max_length) leaves no room for text beside "
                              f"{overhead} special and {name} tokens")
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
    pooling = cfg.pooling or spec.pooling
    head = load_head(spec.head, spec.hidden_size)
    check_dim(cfg.truncate_dim, head.out_features if head is not None else spec.hidden_size)
    if cfg.pooling is None and spec.unsupported_pooling:
        raise OptionError(f"this model's sentence-transformers pooling is {spec.unsupported_pooling!r}, which dice_fast "
                          "does not compute; pass pooling='mean', 'cls' or 'last' to choose the chunk pooling")
    if spec.skipped_modules:
        warnings.warn(f"the model's sentence-transformers pipeline has {', '.join(spec.skipped_modules)}, which "
                      "dice_fast does not apply: its vectors are the pooled transformer outputs (and the Dense, "
                      "LayerNorm and Normalize modules on them before it), not the pipeline's", UserWarning, stacklevel=4)
    settings = Settings(
        config=cfg, spec=spec, device=device, dtype=dtype, window=window, document_wrap=doc_wrap,
        query_wrap=query_wrap, pooling=pooling,
        normalize_chunks=spec.normalizes if cfg.normalize_chunks is None else cfg.normalize_chunks,
        causal=_CAUSAL[cfg.attention],
        max_batch_tokens=cfg.max_batch_tokens or (OPENVINO_BATCH_TOKENS if cfg.openvino else
                                                  default_batch_tokens(device, spec.flops_per_token, dtype)),
        backend=choose_backend(cfg.attention_backend, device, dtype), pooling_impl=pooling_impl,
        pipeline=cfg.pipeline == "on" or (cfg.pipeline == "auto" and device.type == "cuda"),
        document_text_prefix=doc_text, query_text_prefix=query_text, head=head,
        leaves_prompt_out=not spec.pools_prompt and pooling in ("mean", "cls"),
    )
    if cfg.cuda_graphs:  # refused before a forward is compiled or exported, not after
        check_graphable(device, "openvino" if cfg.openvino else settings.backend)
    if cfg.strategy == "late":
        settings.late_windows()  # refuse what late chunking cannot take now, not at the first document
    if cfg.openvino and cfg.attention_backend not in ("auto", "padded"):  # it runs padded rows through its own
        raise OptionError(f"attention_backend={cfg.attention_backend!r} cannot run with {cfg.openvino}: OpenVINO runs "
                          "dense padded rows through its own attention; use attention_backend='auto'")
    if cfg.openvino and settings.causal is not None and settings.causal != spec.is_causal:
        raise OptionError(f"attention={cfg.attention!r} cannot run with {cfg.openvino}: the exported model keeps the "
                          f"model's own ({'causal' if spec.is_causal else 'bidirectional'}) attention; use the torch "
                          "runtime or attention='model default'")
    return settings


GRAPH_BACKENDS = ("flash_attn", "torch_varlen")  # CUDA graphs: cu_seqlens read on the device, no per-batch host data


def precision_name(dtype: torch.dtype, device: torch.device) -> str:
    """"float32", "bfloat16" or "float16"; "float32 (matmuls in tf32)" where torch's float32 matmuls run in
    another precision on ``device`` (`float32_matmuls`): those vectors are not float32's, and the chunk
    cache (keyed by it) keeps them apart."""
    name = dtype_name(dtype)
    relaxed = float32_matmuls(device.type) if dtype == torch.float32 else None
    return f"{name} (matmuls in {relaxed})" if relaxed else name


def check_graphable(device: torch.device, backend: str) -> None:
    """`OptionError` unless small batches on ``device`` with attention ``backend`` can be captured as CUDA
    graphs (`dice_fast.graphs`)."""
    if device.type != "cuda" or backend not in GRAPH_BACKENDS:
        raise OptionError(f"CUDA graphs (cuda_graphs=True) need a CUDA device and attention_backend one of "
                          f"{', '.join(GRAPH_BACKENDS)}, not {device} with {backend!r}")


def check_kind(kind: str) -> str:
    """``kind`` if it is "documents" or "queries", else `OptionError` naming it."""
    if kind not in ("documents", "queries"):
        raise OptionError(f"unknown kind {kind!r}; allowed: 'documents', 'queries'")
    return kind


def check_strategy(strategy) -> str:
    """``strategy`` if it is one of `STRATEGIES`, else `OptionError` naming it."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise OptionError(f"unknown strategy {strategy!r}; allowed: {', '.join(map(repr, STRATEGIES))}")
    return strategy


def default_batch_tokens(device: torch.device, flops_per_token: float, dtype: torch.dtype = torch.float32) -> int:
    """The token budget of a batch when ``max_batch_tokens`` is None: `DEFAULT_BATCH_TOKENS` (4096 on a
    CPU; `AMX_BF16_BATCH_TOKENS` for bf16 on a CPU with AMX), on CUDA by the model's FLOPs per
    token (`CUDA_BATCH_FLOP`, within `CUDA_BATCH_TOKENS`)."""
    if device.type == "cpu" and dtype == torch.bfloat16 and has_amx_bf16():
        return AMX_BF16_BATCH_TOKENS
    if device.type != "cuda" or flops_per_token <= 0:
        return DEFAULT_BATCH_TOKENS.get(device.type, OTHER_DEVICE_BATCH_TOKENS)
    lo, hi = CUDA_BATCH_TOKENS
    want = 1 << max(0, int(np.ceil(np.log2(CUDA_BATCH_FLOP / flops_per_token))))
    return int(min(hi, max(lo, want)))


def placement(config: DiceConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    """Where a model now on ``device`` in ``dtype`` runs under ``config`` (``None`` options: where it is);
    `OptionError` for OpenVINO's paths anywhere but on the CPU, before the model moves."""
    device = parse_device(config.device) if config.device is not None else device
    refuse_openvino_off_cpu(config.openvino, device)
    return device, weight_dtype(config, dtype)


def refuse_openvino_off_cpu(openvino: str | None, device: torch.device) -> None:
    """`OptionError` when ``openvino`` (`DiceConfig.openvino`: the option that puts the forward on OpenVINO)
    would run on ``device`` other than the CPU."""
    if openvino and device.type != "cpu":
        raise OptionError(f"{openvino} runs on the CPU only; got device {device}")


def parse_device(value) -> torch.device:
    """``value`` ("cpu", "cuda", "cuda:1", a torch.device) as a device this process can use; `OptionError`
    naming ``device`` for a malformed one or a GPU this torch cannot reach."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise OptionError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise OptionError(f"device={value!r}, but this torch sees no CUDA device (torch {torch.__version__}); "
                              "use device='cpu'")
        if device.index is not None and device.index >= count:
            raise OptionError(f"device={value!r}, but this torch sees {count} CUDA device(s)")
    elif device.type == "cpu" and device.index not in (None, 0):  # torch takes "cpu:5" and ignores the 5
        raise OptionError(f"device={value!r}: a CPU has no devices to number; use device='cpu'")
    return device


def weight_dtype(config: DiceConfig, current: torch.dtype) -> torch.dtype:
    """The torch dtype a model's weights are kept in under ``config`` (``current``: its own, kept when
    ``dtype`` is None): float32 wherever OpenVINO runs the forward (it exports from these weights and
    rounds to its own precision, LayerNorm and biases staying float32), else the dtype's."""
    if config.dtype is None:
        return current
    return torch.float32 if config.openvino else WEIGHT_DTYPES[config.dtype]


def pretrained_placement(device=None, dtype=None, runtime=None) -> tuple[torch.device, str]:
    """(device, dtype name) of a model to load: CUDA with bfloat16 when available, else CPU with float32
    (CPU whenever OpenVINO runs it: dtype int8 or ``runtime`` "openvino"); a given ``device`` /
    ``dtype`` (a name or a ``torch.dtype``) is kept."""
    on_cpu = str(dtype) == "int8" or runtime == "openvino"
    device = parse_device(device or ("cuda" if torch.cuda.is_available() and not on_cpu else "cpu"))
    dtype = dtype_name(dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if dtype not in WEIGHT_DTYPES:
        raise OptionError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    return device, dtype


def _wrap_ids(spec: ModelSpec, text_prefix: TextPrefix | None) -> tuple[np.ndarray, np.ndarray]:
    ids = text_prefix.ids if text_prefix else ()
    prefix = np.asarray(list(spec.special_prefix) + list(ids), dtype=np.int64)
    return prefix, np.asarray(spec.special_suffix, dtype=np.int64)


def _overhead(wrap) -> int:
    return len(wrap[0]) + len(wrap[1])


__all__ = ["Chunking", "check_strategy", "LATE_MAX_WINDOW", "TORCH_DTYPES", "WEIGHT_DTYPES", "DEFAULT_BATCH_TOKENS", "AMX_BF16_BATCH_TOKENS", "default_batch_tokens", "Settings", "placement", "pretrained_placement", "resolve", "weight_dtype"]
