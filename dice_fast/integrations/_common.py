"""What the integrations share: building the engine from a path or taking a built one, variants of one
loaded encoder, the model's own sentence-transformers config (prompts, similarity), the settings that
shape an encoder's vectors, an encoding in a worker thread that a cancelled caller stops, the refusal of
an over-long query, and descriptions as JSON (optional extras: `dice_fast.errors.require`; the server
client: `_server_client`).

Imports nothing optional at module level (``import dice_fast.integrations`` must stay light).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import OrderedDict

from ..errors import DiceError
from ..models import saved_st_config


class _Abandoned(Exception):
    """Raised in the worker thread of a call whose caller was cancelled (nobody reads it)."""


async def in_thread_until_cancelled(work):
    """``await`` ``work(progress)`` (an encoding call taking a ``progress(done, total)`` callback) in a worker
    thread; a cancelled caller stops it at its next batch, where ``progress`` raises. (It ran the whole
    call on: six abandoned calls held every thread of the event loop's default executor for seconds.)"""
    stop = threading.Event()

    def progress(done: int, total: int) -> None:
        if stop.is_set():
            raise _Abandoned

    try:
        return await asyncio.to_thread(work, progress)
    except asyncio.CancelledError:
        stop.set()
        raise


def as_encoder(encoder, options: dict, applies_prompts: bool = False):
    """``encoder``: a `DiceEncoder` (used as is; ``options`` must then be empty), a local model folder,
    or None (the bundled all-MiniLM-L6-v2), loaded with ``options`` (`DiceConfig` fields).
    ``applies_prompts``: the caller applies the folder's prompts itself (as sentence-transformers or MTEB
    do), so a folder loaded here has no prefixes unless ``options`` give them (not the model's prompts)."""
    from dice_fast import DiceEncoder

    if isinstance(encoder, DiceEncoder):
        if options:
            raise TypeError(f"options {sorted(options)} only apply when loading a model; the DiceEncoder passed "
                            "already has its options (build it with them, or use encoder.config.replace)")
        return encoder
    if encoder is not None and not isinstance(encoder, (str, os.PathLike)):
        raise TypeError(f"expected a DiceEncoder, a model folder or None, got {type(encoder).__name__}")
    if applies_prompts:
        options = {"document_prefix": "", "query_prefix": "", **options}
    return DiceEncoder.from_pretrained(encoder, **options)


class Variants:
    """`DiceEncoder`s over one encoder's loaded model and tokenizer with some options changed (a prompt
    as ``document_prefix`` / ``query_prefix``, a smaller ``max_batch_tokens``): built once per set of
    changes, shared, thread-safe; the model is never copied or moved, and the base encoder's own copy
    of the tokenizer is shared with its lock. A variant reads the model facts from the same folder
    (``model_path``), reuses chunks through the same persistent chunk cache (in the namespace of its
    own settings) and counts them in the base encoder's ``chunk_stats``. The `MAX_VARIANTS` used last
    are kept (a prompt per call made one variant each, kept forever: ~7 MB and 115 ms each)."""

    MAX_VARIANTS = 32

    def __init__(self, encoder):
        self.base = encoder
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, **changes):
        from dice_fast import DiceEncoder

        base = self.base
        current = {"max_batch_tokens": base.max_batch_tokens}
        changes = {k: v for k, v in changes.items() if current.get(k, getattr(base.config, k)) != v}
        if not changes:
            return base
        key = tuple(sorted(changes.items()))
        with self._lock:
            enc = self._cache.get(key)
            if enc is not None:
                self._cache.move_to_end(key)
            else:
                store = None if base.cache is None else base.cache.cache  # the open ChunkCache of its namespace
                enc = DiceEncoder(base.model, base.engine_tokenizer, config=base.config.replace(**changes),
                                  model_path=base.model_path, cache=store)
                enc.chunk_stats = base.chunk_stats
                if enc.spec != base.spec:
                    raise ValueError(
                        "cannot derive an encoder with changed options: the model facts read again differ from the "
                        f"encoder's ({enc.spec} vs {base.spec}); build the encoder with DiceEncoder.from_pretrained(path)")
                self._cache[key] = enc
                while len(self._cache) > self.MAX_VARIANTS:
                    self._cache.popitem(last=False)
        return enc


def st_config(encoder) -> dict:
    """The model folder's ``config_sentence_transformers.json`` as a dict, ``{}`` when there is none."""
    return saved_st_config(str(encoder.spec.name))


def model_prompts(encoder) -> tuple[dict, str | None]:
    """(prompts, default_prompt_name) from the model folder's ``config_sentence_transformers.json``,
    ``({}, None)`` when there is none."""
    cfg = st_config(encoder)
    prompts = cfg.get("prompts") if isinstance(cfg.get("prompts"), dict) else {}
    prompts = {str(k): str(v) for k, v in prompts.items()}
    default = cfg.get("default_prompt_name")
    return prompts, default if isinstance(default, str) and default in prompts else None


def vector_settings(encoder) -> dict:
    """Everything that shapes ``encoder``'s vectors, resolved (JSON-able): every `DiceConfig` option of
    role "vector" or "precision" (``DiceConfig.options_of("vector", "precision")``), the pooling, window,
    precision, device type and width, and the late-chunking windows. Two encoders of one model whose
    settings are equal give the same vectors (to float rounding)."""
    from dice_fast import DiceConfig

    enc, c = encoder, encoder.config
    options = {k: getattr(c, k) for k in DiceConfig.options_of("vector", "precision")}
    options.update(pooling=enc.pooling, normalize_chunks=enc.normalize_chunks, max_length=enc.window,
                   dtype=enc.precision, device=enc.device.type, dim=enc.dim)
    if c.strategy == "late":  # late chunking's windows shape its vectors too (resolved)
        text_tokens, options["window_overlap"] = enc.settings.late_windows()
        options["window_tokens"] = text_tokens + enc.chunk_overhead
    return options


def hit_metadata(hit, scoring: str) -> dict:
    """A store's `Hit` as the retrievers hand it on: {"text" (the passage), "id", "score", "scoring",
    "chunk", "start_char", "end_char", "chunk_score"}; ValueError when the store keeps no texts."""
    if hit.text is None:
        raise ValueError("the retriever returns passages, but this store does not store its texts; build it with "
                         "DiceIndex.from_texts(encoder, texts, ids) or a store's add(texts, ids) (store_text=True)")
    return {"text": hit.text, "id": hit.id, "score": float(hit.score), "scoring": scoring, "chunk": int(hit.chunk),
            "start_char": int(hit.start_char), "end_char": int(hit.end_char), "chunk_score": float(hit.chunk_score)}


class QueryTooLong(DiceError, ValueError):
    """A query longer than the model window, refused in-process and through a server alike; ``index``:
    its position among the texts of the call."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


def jsonable(value):
    """``value`` with paths as strings and anything JSON has no type for (a ``torch.device``) as its
    ``str``: a description goes through ``json.dumps`` (LlamaIndex's ``to_json``, its cache keys)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
