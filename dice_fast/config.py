"""Options of a `DiceEncoder`, validated once when the encoder is built.

Each option is stated once, here: its field carries its default and its help (`option`), and from
those `dice_fast.cliargs` generates every command's flag and ``docs/make_docs.py`` the options table
of ``docs/python.md``. Adding an option is adding a field with `option(...)` (and its check below).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass

from .errors import ArgumentTypeError, OptionError
from .ops import IMPLS
from .ops.names import AGGREGATIONS, POOLINGS, check_aggregation, check_pooling

STRATEGIES = ("dice", "single", "late")
POSITIONS = ("local", "global")
ATTENTION_MODES = ("model default", "causal", "bidirectional")
ATTENTION_BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa_groups", "padded")
# int8: static int8 on the CPU (dice_fast.quant), the float32 model kept for its facts and export
DTYPES = ("float32", "bfloat16", "float16", "auto", "int8")
DEFAULT_CHUNK_SIZE = 256
COMPILE_MODES = ("off", "on", "auto")
RUNTIMES = ("torch", "openvino")
PIPELINE_MODES = ("auto", "on", "off")


# what an option changes (`option`'s ``role``): "vector", what a vector is (chunking, pooling, prefixes
# ...: an index pins these); "precision", where and at what precision the forward runs (the same vectors
# up to that precision's rounding: an index does not pin these, a resumed corpus job does); "speed", how
# fast the vectors come (the same vectors, bit for bit or to float32 rounding: nothing pins these)
ROLES = ("vector", "precision", "speed")


def option(default, help: str, *, default_help: str | None = None, detail: str = "", choices=None,
           metavar: str | None = None, role: str = "vector", empty_text: bool = False):
    """A `DiceConfig` field with its documentation, the one place an option is described.

    help: one line (plain text) saying what the option does; the flag's ``--help`` and the first part
        of its line in the options table. default_help: what the default means, where ``default``
        alone does not say it (needed for a ``None`` default: "4096 on CPU, 65536 on CUDA").
    detail: more for the options table only (Markdown). choices: the allowed values (the flag
        refuses others). metavar: the flag's value name in ``--help``.
    The flag's form follows the field: ``--name-with-dashes VALUE``; for a bool that defaults to
    True ``--no-name`` (its help then reads "do not <help>": phrase a bool's help as an action), to
    False ``--name``, to None ``--name/--no-name``. role: what the option changes, one of `ROLES`.
    empty_text: ``""`` is one of its values (a prefix's "none"), so an empty environment variable sets
    it rather than leaving it unset.
    """
    if role not in ROLES:
        raise OptionError(f"role must be one of {ROLES}, got {role!r}")
    meta = {"help": help, "default_help": default_help, "detail": detail,
            "choices": None if choices is None else tuple(choices), "metavar": metavar, "role": role,
            "empty_text": empty_text}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class DiceConfig:
    """Every option of the engine: each field's help is in its `option` metadata (``--help`` of any
    command, or the options table of ``docs/python.md``)."""

    chunk_size: int | None = option(
        None, "tokens of document text per chunk; special tokens and prefix come on top",
        default_help="min(256, model window - special tokens - prefix)")
    overlap: int = option(0, "tokens shared by consecutive chunks", detail="`0 <= overlap < chunk_size`.")
    positions: str = option(
        "local", "local: restart at the model's first position in every chunk (DICE); global: the chunk's "
        "offset in the document (the paper's ablation; must fit the position table)", choices=POSITIONS)
    pooling: str | None = option(
        None, "token -> chunk pooling", choices=POOLINGS,
        default_help="the model's sentence-transformers setting, else mean",
        detail='`"mean"`: all tokens of the wrapped chunk, specials included, as sentence-transformers does; '
        '`"cls"`: the first token; `"last"`: the last token. A model whose sentence-transformers pooling is '
        'another (max, weighted mean, several concatenated) is refused until `pooling` is given.')
    aggregation: str = option(
        "mean", "chunk -> document", choices=AGGREGATIONS,
        detail='`"mean"`; `"weighted_mean"` (by the chunk\'s token count, specials included); `"max"` '
        '(element-wise); `"topk_norm"` (mean of the `top_k` chunks of largest L2 norm; ties: the earlier '
        'chunk; norms equal to float rounding, as after a final LayerNorm of unit weight, may rank apart '
        'from a float64 computation of the same chunks); `"softmax_norm"` (weights '
        '`softmax(norm / temperature)`, temperature at least 1e-30; a low temperature magnifies the norms\' '
        'float rounding likewise: ~1e-5 at 0.05 over such norms).')
    top_k: int = option(2, "chunks kept by topk_norm", detail="All of them when a document has fewer.")
    temperature: float = option(1.0, "temperature of softmax_norm")
    normalize_chunks: bool | None = option(
        None, "L2-normalise chunk vectors before aggregating",
        default_help="on when the model ends in a sentence-transformers Normalize module",
        detail="So chunk vectors match that model's own output; norm-based aggregations still rank by the "
        "norm as pooled. The default is settled by the ablation in `benchmarks/RESULTS.md` §5.3.")
    normalize: bool = option(True, "L2-normalise the returned document and query vectors")
    truncate_dim: int | None = option(
        None, "keep the first N components of document, query and chunk vectors (Matryoshka), "
        "re-normalised when normalize is on (document and query vectors) or normalize_chunks (chunk vectors)",
        default_help="the model's width", metavar="N",
        detail="Aggregation runs on the full chunk vectors; must be at most the model's width.")
    strategy: str = option(
        "dice", "dice: every chunk encoded alone; single: the single-vector baseline (one window of each "
        "document's first tokens); late: late chunking (chunks pooled inside windows of the document)",
        choices=STRATEGIES,
        detail='`"single"` encodes `max_length` tokens of each document: `chunk_size`, `overlap` and '
        '`max_chunks_per_document` do not apply to it. `"late"`: each window of `window_tokens` runs once and '
        'every chunk is the mean of its own tokens\' states in it, so a chunk carries its context; needs mean '
        'pooling, `overlap=0` and local positions. See [late-chunking.md](late-chunking.md).')
    window_tokens: int | None = option(
        None, "strategy late: tokens of one window, specials included",
        default_help="the model's position table, at most 8192",
        detail="At most the model's position table; must hold one chunk plus `window_overlap`.")
    window_overlap: int | None = option(
        None, "strategy late: tokens consecutive windows share (each chunk keeps half of them as context on "
        "either side)", default_help="min(128, a quarter of the window's text tokens, what it holds beside one chunk)")
    attention: str = option(
        "model default", "causal or bidirectional attention", choices=ATTENTION_MODES,
        default_help="the model's own",
        detail="An override for LLM2Vec / Dream-style decoder embedders; refused on a model that needs the "
        "padded fallback.")
    attention_backend: str = option(
        "auto", "varlen attention implementation", choices=ATTENTION_BACKENDS, default_help="best available",
        detail='`"flash_attn"`, `"torch_varlen"`, `"sdpa_groups"` run packed; `"padded"` is the exact fallback '
        '(dense padded batches with the model\'s own attention), chosen by `"auto"` for models that cannot '
        'run packed.', role="speed")
    document_prefix: str | None = option(
        None, 'text put after the special prefix of every chunk, e.g. "passage: "',
        default_help="the model folder's sentence-transformers \"document\" prompt, else none",
        detail="The default is the prompt sentence-transformers' `encode_document` applies (the folder's "
        "saved `\"document\"` prompt in `config_sentence_transformers.json`; its `\"query\"` prompt for "
        "`query_prefix`); `\"\"`: none. Prefix and text get the ids they have tokenized together, as "
        "sentence-transformers' prompts do (a trailing space is no token of its own where "
        'the vocabulary merges it: with byte-level BPE the text\'s first word takes it, '
        '"Ġthe", not "the"; where it does not, it is a token of the first chunk), and spans '
        "stay in the text; where one token would span both (\"query:\" then \",\" as "
        "\":,\"), the text gets its own ids. Likewise `query_prefix`.", empty_text=True)
    query_prefix: str | None = option(
        None, 'text put after the special prefix of every query, e.g. "query: "',
        default_help="the model folder's sentence-transformers \"query\" prompt, else none", empty_text=True)
    max_chunks_per_document: int | None = option(None, "keep only each document's first N chunks",
                                                 default_help="all", metavar="N")
    max_length: int | None = option(
        None, "model window in tokens, specials included (queries and strategy single)",
        default_help="sentence-transformers max_seq_length, else the tokenizer's model_max_length, else the "
        "position table")
    max_batch_tokens: int | None = option(
        None, "token budget of one packed forward",
        default_help="4096 on CPU (8192 for bf16 on a CPU with AMX, and on OpenVINO: dtype int8 or runtime openvino); on CUDA 65,536 to 524,288 by the model's FLOPs per token",
        detail="On CUDA the default gives a batch about 16 TFLOP of work (a power of two of tokens, "
        "see [gpu.md](gpu.md)): 524,288 tokens for MiniLM-L6, 131,072 for BERT-base, 65,536 from ~0.25 "
        "GFLOP per token up.", role="speed")
    device: str | None = option(None, "where the model runs: cpu, cuda, cuda:1 ...",
                                default_help="cuda if available, else cpu", role="precision")
    dtype: str | None = option(
        None, "model precision; auto (CPU): the fastest forward on this machine whose vectors agree with "
        "float32 (cos >= auto_agreement, 0.999, on held-out prose), measured once and cached", choices=DTYPES,
        default_help="bfloat16 on CUDA, float32 on CPU",
        detail='`"auto"` measures float32, bfloat16 (only where the CPU has avx512_bf16 or AMX) and, with '
        '`compile`, compiled forwards, where OpenVINO is installed its float32 and bfloat16 forwards (`runtime`), '
        '(and int8 when `auto_agreement` is below 0.999), once per machine and model; '
        '`print(encoder)` shows the choice. '
        'See [cpu.md](cpu.md). `"int8"`: static int8 on a CPU with VNNI or AMX (OpenVINO + NNCF, the `int8` '
        'extra), calibrated on text; not exact: its agreement with float32 is stated in [int8.md](int8.md).',
        role="precision")
    auto_agreement: float = option(
        0.999, "dtype auto / compile auto: least cosine to float32 eager (every measured chunk) a path must "
        "keep to be chosen",
        detail="Measured on held-out prose chunks of the encoder's chunk size. At the default (bf16 rounding) only "
        "the float paths can qualify; set below it, the int8 path (the `int8` extra, a CPU with VNNI or AMX, "
        "calibrated on the bundled prose) is measured too and chosen if it is the fastest path that keeps the "
        "bound (int8 MiniLM: cos min 0.995, so `0.99` admits it). See [cpu.md](cpu.md).",
        role="precision")
    runtime: str | None = option(
        None, "what runs the forward: torch (PyTorch, dice_fast's packed forward) or openvino (the model "
        "exported to OpenVINO's fused CPU graph, one stream per core)", choices=RUNTIMES,
        default_help="openvino for dtype int8, else torch",
        detail='`"openvino"` (CPU, the `int8` extra) runs dtype `"float32"`, `"bfloat16"` (a CPU with '
        'avx512_bf16 or AMX) or `"int8"`, strategies dice and single; not bit-exact with PyTorch: its '
        'agreement is stated in [cpu.md](cpu.md). `dtype="auto"` measures it too where OpenVINO is installed.',
        role="precision")
    calibration: str | None = option(
        None, "dtype int8 only: a UTF-8 text file (a sample of your corpus) to calibrate the int8 model on",
        default_help="the first half of the bundled prose", metavar="FILE", role="precision")
    pooling_impl: str = option(
        "auto", "segment pooling implementation (dice_fast.ops)", choices=IMPLS,
        detail='`"triton"` (CUDA), `"native"` (the C++ extension), `"torch"` (vectorised PyTorch, the CPU '
        'default without the extension), `"reference"` / `"ref"` (the float64 spec; tests only). '
        'See [ops.md](ops.md).', role="speed")
    dedup: bool = option(
        True, "reuse chunk vectors (across documents, calls and the persistent cache)",
        detail="On: identical chunks run once and known ones come from the persistent cache. Off runs every chunk, "
        "and the persistent cache is neither read nor written (the baseline of "
        "`benchmarks/bench_cache.py`); the vectors are the same either way up to float rounding (a chunk's "
        "last bits may depend on the batch it ran in: ~1e-7 on the CPU, up to ~2e-6 on the padded "
        "fallback). See [reuse.md](reuse.md).", role="speed")
    compile: str = option(
        "off", "run the packed forward under torch.compile (inductor), compiled once per encoder at construction",
        choices=COMPILE_MODES,
        detail='`"on"`: compiled (refused for a model on the padded fallback); `"auto"`: compiled and eager '
        'forwards are both candidates of `dtype="auto"` (with an explicit dtype: the fastest of its forwards, '
        'OpenVINO\'s included where installed and `runtime` is not "torch"). '
        'See [cpu.md](cpu.md).', role="speed")
    pipeline: str = option(
        "auto", "select, pack and copy the next batch to the device in a producer thread while the current "
        "one runs", choices=PIPELINE_MODES, default_help="on for CUDA, off elsewhere",
        detail="Two batches in flight, one host-to-device copy per batch from a persistent pinned buffer; "
        "the batches and vectors are those of the serial loop, bit for bit. See [gpu.md](gpu.md).", role="speed")
    cuda_graphs: bool = option(
        False, "replay small packed batches (serving, queries) as CUDA graphs, one per token-count bucket",
        detail="CUDA with `flash_attn` or `torch_varlen` only; batches up to 4,096 tokens are padded with dummy chunks "
        "to their bucket (vectors unchanged: attention is block-diagonal); larger ones run as before. See "
        "[gpu.md](gpu.md).", role="speed")

    def __post_init__(self):
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("positions", self.positions, POSITIONS)
        _choice("attention", self.attention, ATTENTION_MODES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.pooling is not None:
            check_pooling(self.pooling)
        for name in ("top_k", "chunk_size", "truncate_dim", "max_chunks_per_document", "max_length", "window_tokens",
                     "max_batch_tokens", "window_overlap", "overlap"):
            self._set(name, checked_integer(name, getattr(self, name), minimum=0 if "overlap" in name else 1,
                                     optional=name not in ("top_k", "overlap")))
        # a finite number whatever the aggregation (the index and a resumed job compare it as recorded: NaN
        # never equals itself); softmax_norm's own bound below
        self._set("temperature", _real("temperature", self.temperature, -math.inf, math.inf,
                                                what="a finite number"))
        check_aggregation(self.aggregation, self.top_k, self.temperature)
        if self.chunk_size is not None and self.overlap >= self.chunk_size:
            raise OptionError(
                f"overlap ({self.overlap}) must be smaller than chunk_size ({self.chunk_size}); "
                "allowed: 0 <= overlap < chunk_size"
            )
        for name in ("document_prefix", "query_prefix"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ArgumentTypeError(f"{name} must be a string (or None: the model's prompt), "
                                        f"got {type(getattr(self, name)).__name__}")
        for name in ("normalize", "normalize_chunks", "dedup", "cuda_graphs"):
            value = getattr(self, name)
            if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):  # numpy.True_
                self._set(name, value := bool(value))
            if not (isinstance(value, bool) or (value is None and name == "normalize_chunks")):
                raise ArgumentTypeError(f"{name} must be True or False, got {value!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise OptionError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _choice("compile", self.compile, COMPILE_MODES)
        if self.runtime is not None:
            _choice("runtime", self.runtime, RUNTIMES)
        if self.runtime == "torch" and self.dtype == "int8":
            raise OptionError("dtype='int8' runs on OpenVINO; runtime='torch' cannot run it (use runtime=None or "
                              "'openvino', or a float dtype)")
        if self.openvino and (self.compile == "on" or (self.compile == "auto" and self.dtype != "auto")):
            raise OptionError(f"compile={self.compile!r} chooses PyTorch's compiled forward; {self.openvino} runs "
                              "OpenVINO's own compiled graph: use compile='off'")
        if self.runtime == "openvino" and self.dtype == "float16":
            raise OptionError("runtime='openvino' runs float32, bfloat16 or int8 on the CPU, not float16")
        _choice("pipeline", self.pipeline, PIPELINE_MODES)
        self._set("auto_agreement", _real("auto_agreement", self.auto_agreement, 0.0, 1.0, above=True,
                                          what="a cosine in (0, 1]"))
        if isinstance(self.calibration, os.PathLike):  # a pathlib.Path is kept as the str it names
            object.__setattr__(self, "calibration", os.fspath(self.calibration))
        if self.calibration is not None and not isinstance(self.calibration, str):
            raise OptionError(f"calibration must be a text file path (str or os.PathLike), got {self.calibration!r}")
        if self.calibration is not None and self.dtype != "int8":
            raise OptionError(f"calibration (a text file path) applies to dtype='int8' only; got "
                             f"calibration={self.calibration!r} with dtype={self.dtype!r}")
        _choice("pooling_impl", self.pooling_impl, IMPLS)

    def _set(self, name: str, value) -> None:  # a checked value in its plain Python type (frozen dataclass)
        object.__setattr__(self, name, value)

    @property
    def openvino(self) -> str | None:
        """The option that puts the forward on OpenVINO (``"dtype='int8'"`` or ``"runtime='openvino'"``,
        for error messages), None where PyTorch runs it."""
        if self.dtype == "int8":
            return "dtype='int8'"
        return "runtime='openvino'" if self.runtime == "openvino" else None

    def replace(self, **changes) -> DiceConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def changed(self, names, shown=()) -> str:
        """", name=value" for each option of ``names`` not in ``shown`` whose value is not its default (a
        text option resolved to ``""`` where the default None stands for the model's own counts as the default)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        return "".join(f", {n}={getattr(self, n)!r}" for n in names if n not in shown
                       and getattr(self, n) not in (fields[n].default, "" if fields[n].default is None else None))

    @classmethod
    def check_names(cls, options) -> None:
        """`ArgumentTypeError` naming the keys of ``options`` that are no option."""
        if unknown := set(options) - set(cls.field_names()):
            raise ArgumentTypeError(f"unknown option(s) {sorted(unknown)}; allowed: {', '.join(cls.field_names())}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def options_of(cls, *roles: str) -> tuple[str, ...]:
        """The fields whose `option` role is one of ``roles`` (see `ROLES`), in field order."""
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise OptionError(f"unknown role {sorted(unknown)[0]!r}; allowed: {', '.join(ROLES)}")
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["role"] in roles)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise OptionError(f"unknown {name} {value!r}; allowed: {', '.join(map(repr, allowed))}")


_INT64_MAX = 2**63 - 1  # counts go to torch and numpy as int64


def dtype_name(dtype) -> str:
    """A dtype's name as the ``dtype`` option spells it: "bfloat16" for torch.bfloat16 or "bfloat16"."""
    return str(dtype).replace("torch.", "")


def checked_integer(name: str, value, minimum: int = 1, optional: bool = False) -> int | None:
    """``value`` as a plain int (a numpy integer is the int it holds); `OptionError` naming ``name`` for
    None (unless ``optional``), a bool, a float, a string, or a value outside ``minimum``..2**63-1. Every
    count an API takes (options, k, batch sizes, limits) is checked here."""
    if value is None and optional:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not minimum <= value <= _INT64_MAX:
        raise OptionError(f"{name} must be an integer >= {minimum}{' or None' if optional else ''}, got {value!r}")
    return int(value)


def _real(name: str, value, low: float, high: float, above: bool = False, what: str = "") -> float:
    """``value`` as a float (any real number: numpy's too, not a bool), within [``low``, ``high``] (``above``:
    ``low`` excluded); `OptionError` naming ``name`` otherwise (NaN included)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    x = float(value) if ok else math.nan
    if not ((low < x if above else low <= x) and x <= high and math.isfinite(x)):
        raise OptionError(f"{name} must be {what or f'a finite number >= {low:g}'}, got {value!r}")
    return x


__all__ = ["DiceConfig", "option", "checked_integer", "dtype_name", "DTYPES", "COMPILE_MODES", "RUNTIMES", "PIPELINE_MODES", "STRATEGIES", "POSITIONS", "ATTENTION_MODES",
           "ATTENTION_BACKENDS", "POOLINGS", "AGGREGATIONS"]
