"""A sentence-transformers-shaped front of the engine, so code written for ``SentenceTransformer`` runs
unchanged with DICE document vectors.

    from dice_fast.integrations.sentence_transformers import DiceSentenceEncoder
    model = DiceSentenceEncoder()                         # bundled all-MiniLM-L6-v2; or a folder / a DiceEncoder
    docs = model.encode(texts, convert_to_tensor=True, normalize_embeddings=True)   # documents through DICE
    qs = model.encode_query(["what is ...?"])             # one window each, the "query" prompt if any
    scores = model.similarity(qs, docs)

Differences from ``SentenceTransformer.encode``, by design:

* ``encode`` / ``encode_document`` / ``task="document"`` encode **documents**: chunked, each chunk
  encoded alone, chunk vectors aggregated (a text of at most ``chunk_size`` tokens is one chunk and
  gets the single-window vector, to float rounding). ``encode_query`` / ``task="query"`` encode **queries**: one
  model window each, cut to it with a warning when longer.
* A prompt is given to the engine as ``document_prefix`` / ``query_prefix``: its tokens follow the
  special prefix of **every chunk** (of the query), instead of being glued to the text once; for
  WordPiece/BPE tokenizers that split at spaces this is the same token sequence sentence-transformers
  builds. A resolved prompt replaces the encoder's own prefix for that call.
* Vectors are L2-normalised as the model's own pipeline does: a model folder (or the bundled model)
  loaded here normalises when its sentence-transformers pipeline ends in ``Normalize`` (unless
  ``normalize=`` is given); a `DiceEncoder` passed in keeps its own ``normalize`` option.
  ``normalize_embeddings=True`` normalises them, ``False`` leaves them as the encoder returns them.
* ``truncate_dim`` is the engine's option (`dice_fast.matryoshka`): the first N components,
  re-normalised when the encoder normalises. sentence-transformers leaves a truncated vector shorter
  than 1 unless ``normalize_embeddings``; cosine similarities are the same either way.
* ``batch_size`` is a memory cap, not a speed knob: one packed forward holds at most
  ``batch_size * max_seq_length`` tokens (what a sentence-transformers batch of that size can hold),
  and never more than the encoder's ``max_batch_tokens``. Default (None): the encoder's budget.
  Vectors change with it only by float32 rounding (about 1e-7).
* Prompts as in sentence-transformers 6: ``"query"`` and ``"document"`` are always among the prompts
  (``""`` unless given or saved), so ``encode_query`` / ``encode_document`` never fall back to
  ``default_prompt_name``; an empty prompt is no prompt (the encoder's own prefix applies: none for a
  folder loaded here, the folder's prompts by default for a `DiceEncoder` passed in).
* ``similarity`` / ``similarity_pairwise`` follow ``similarity_fn_name`` ("cosine", "dot", "euclidean",
  "manhattan": negative distances), as sentence-transformers computes them; default: the model
  folder's ``config_sentence_transformers.json``, else "cosine".
* Only ``output_value="sentence_embedding"`` and ``precision="float32"``; no multi-process ``pool``.
  An empty input gives an array / tensor of shape ``(0, dim)``.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from ..config import checked_integer
from ..errors import OptionError
from ..matryoshka import check_dim
from ..models import pipeline_normalizes
from ._common import Variants, as_encoder, model_prompts, st_config

__all__ = ["DiceSentenceEncoder"]

_DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # what encode_document looks for, as in sentence-transformers
_TASKS = (None, "document", "query")
_SEEDED_PROMPTS = ("query", "document")  # sentence-transformers 6 always has these (empty unless given or saved)
SIMILARITY_FNS = ("cosine", "dot", "euclidean", "manhattan")  # what SentenceTransformer supports


class DiceSentenceEncoder:
    """sentence-transformers-shaped ``encode`` over a `DiceEncoder`.

    encoder: a `DiceEncoder`, a local model folder, or None (the bundled all-MiniLM-L6-v2); a folder or
        None is loaded with ``options`` (`DiceConfig` fields: chunk_size, aggregation, device, dtype ...).
    prompts: ``{name: text}`` as in sentence-transformers (``{"query": "query: ", "document": "passage: "}``),
        merged as sentence-transformers 6 merges them: ``"query"`` and ``"document"`` first (``""``), then
        these, then the model folder's saved prompts for names still unset. default_prompt_name: used when a
        call names no prompt (``encode``; ``encode_query`` / ``encode_document`` name theirs); None: the
        model folder's.
    truncate_dim: keep the first ``truncate_dim`` dimensions of every vector (Matryoshka models), as the
        engine's ``truncate_dim`` option does.
    similarity_fn_name: "cosine", "dot", "euclidean" or "manhattan" (`SIMILARITY_FNS`); None: the model
        folder's ``similarity_fn_name``, else "cosine".
    """

    def __init__(self, encoder=None, prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
                 truncate_dim: int | None = None, similarity_fn_name: str | None = None, **options):
        if isinstance(encoder, (str, os.PathLike)) and os.path.isdir(encoder) and "normalize" not in options:
            # as SentenceTransformer: normalised only by a Normalize module (a dot-product model's
            # vectors were made unit length, its scores and ranking changed); a hub name keeps the default
            options = {**options, "normalize": pipeline_normalizes(encoder)}
        self.encoder = as_encoder(encoder, options, applies_prompts=True)
        self._variants = Variants(self.encoder)
        own, own_default = model_prompts(self.encoder)
        merged: dict = dict.fromkeys(_SEEDED_PROMPTS)
        merged.update(prompts or {})
        merged.update({k: v for k, v in own.items() if merged.get(k) is None})
        self.prompts = {k: "" if v is None else v for k, v in merged.items()}
        self.default_prompt_name = own_default if default_prompt_name is None else default_prompt_name
        if self.default_prompt_name is not None and self.default_prompt_name not in self.prompts:
            raise ValueError(f"default_prompt_name {self.default_prompt_name!r} is not in prompts {sorted(self.prompts)}")
        self.truncate_dim = check_dim(truncate_dim, self.encoder.dim)
        saved = st_config(self.encoder).get("similarity_fn_name")
        self.similarity_fn_name = similarity_fn_name if similarity_fn_name is not None else (
            saved if saved in SIMILARITY_FNS else "cosine")

    @property
    def similarity_fn_name(self) -> str:
        """What ``similarity`` computes: "cosine", "dot", "euclidean" or "manhattan"."""
        return self._similarity_fn_name

    @similarity_fn_name.setter
    def similarity_fn_name(self, value) -> None:
        value = getattr(value, "value", value)  # sentence-transformers' SimilarityFunction enum too
        value = "cosine" if value is None else value
        if value not in SIMILARITY_FNS:
            raise OptionError(f"unknown similarity_fn_name {value!r}; allowed: {', '.join(map(repr, SIMILARITY_FNS))}")
        self._similarity_fn_name = value

    # -- what sentence-transformers code reads off a model -------------------------------------
    @property
    def device(self):
        return self.encoder.device

    @property
    def tokenizer(self):
        return self.encoder.tokenizer

    @property
    def max_seq_length(self) -> int:
        """The model window in tokens (special tokens included): the most a query holds."""
        return self.encoder.window

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        # as in sentence-transformers (``model.max_seq_length = 256`` raised AttributeError): the engine's
        # max_length (queries are cut to it), on a variant sharing the model; documents keep chunk_size
        self.encoder = self._variants.get(max_length=value)
        self._variants = Variants(self.encoder)

    def get_sentence_embedding_dimension(self) -> int:
        return self.truncate_dim or self.encoder.dim

    def get_embedding_dimension(self) -> int:
        return self.get_sentence_embedding_dimension()

    def __repr__(self) -> str:
        return f"DiceSentenceEncoder({self.encoder!r}, prompts={self.prompts!r})"

    # -- encoding ----------------------------------------------------------------------------------
    def encode(self, sentences: str | Iterable[str] | None = None, prompt_name: str | None = None,
               prompt: str | None = None, batch_size: int | None = None, show_progress_bar: bool | None = None,
               output_value: str | None = "sentence_embedding", precision: str = "float32",
               convert_to_numpy: bool = True, convert_to_tensor: bool = False, device=None,
               normalize_embeddings: bool = False, truncate_dim: int | None = None, pool=None,
               chunk_size: int | None = None, *, inputs: str | Iterable[str] | None = None,
               task: str | None = None, **kwargs):
        """Encode a string (-> 1-D vector) or a list of strings (-> 2-D), as documents, or as queries
        with ``task="query"``. Arguments as in ``SentenceTransformer.encode`` (``inputs`` is the newer
        name of ``sentences``); see the module docstring for what differs."""
        if kwargs:
            raise TypeError(f"DiceSentenceEncoder.encode() got unexpected keyword arguments {sorted(kwargs)}")
        if inputs is not None:
            if sentences is not None:
                raise TypeError("pass sentences or inputs, not both")
            sentences = inputs
        if sentences is None:
            raise TypeError("encode() needs the texts to encode (sentences=...)")
        _check_unsupported(output_value, precision, pool, chunk_size, task)
        if device is not None and _device_type(device) != self.encoder.device.type:
            raise ValueError(f"this encoder runs on {self.encoder.device}; build it with device={device!r} instead")
        truncate = check_dim(truncate_dim, self.encoder.dim) or self.truncate_dim

        single = isinstance(sentences, str)
        texts = [sentences] if single else (sentences.tolist() if isinstance(sentences, np.ndarray) else list(sentences))
        enc = self._encoder_for(task, self._resolve_prompt(prompt, prompt_name), batch_size, truncate)
        show = bool(show_progress_bar)
        vecs = enc.encode_queries(texts, show_progress=show) if task == "query" else \
            enc.encode_documents(texts, show_progress=show)
        if normalize_embeddings and len(vecs):
            vecs = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12).astype(np.float32)
        return _convert(vecs.astype(np.float32, copy=False), single, convert_to_numpy, convert_to_tensor,
                        self.encoder.device)

    def encode_query(self, sentences=None, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """``encode`` of queries (one window each); the ``"query"`` prompt when there is one and none is named."""
        if prompt_name is None and prompt is None and "query" in self.prompts:
            prompt_name = "query"
        return self.encode(sentences, prompt_name=prompt_name, prompt=prompt, task="query", **kwargs)

    def encode_document(self, sentences=None, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """``encode`` of documents (DICE); the first of the ``"document"``, ``"passage"``, ``"corpus"``
        prompts there is when none is named."""
        if prompt_name is None and prompt is None:
            prompt_name = next((p for p in _DOCUMENT_PROMPTS if p in self.prompts), None)
        return self.encode(sentences, prompt_name=prompt_name, prompt=prompt, task="document", **kwargs)

    # -- similarity (``similarity_fn_name``, computed as sentence-transformers computes it) ----------
    def similarity(self, embeddings1, embeddings2):
        """(n1, n2) float32 torch tensor of ``similarity_fn_name`` between every row of each; 1-D inputs
        count as one row. "euclidean" / "manhattan" are negative distances (higher is closer)."""
        return _similarity(self.similarity_fn_name, _rows(embeddings1), _rows(embeddings2), pairwise=False)

    def similarity_pairwise(self, embeddings1, embeddings2):
        """(n,) float32 torch tensor of ``similarity_fn_name`` between row i of each."""
        return _similarity(self.similarity_fn_name, _rows(embeddings1), _rows(embeddings2), pairwise=True)

    # ----------------------------------------------------------------------------------------------
    def _resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        if prompt is not None:
            return prompt
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return None
        if name not in self.prompts:
            raise ValueError(f"prompt name {name!r} is not among the prompts {sorted(self.prompts)}")
        return self.prompts[name] or None  # "" (e.g. the seeded "query" / "document"): no prompt

    def _encoder_for(self, task, prompt: str | None, batch_size: int | None, truncate_dim: int | None = None):
        changes = {} if truncate_dim is None else {"truncate_dim": truncate_dim}
        if prompt is not None:
            changes["query_prefix" if task == "query" else "document_prefix"] = prompt
        if batch_size is not None:
            batch_size = checked_integer("batch_size", batch_size)
            changes["max_batch_tokens"] = min(self.encoder.max_batch_tokens, batch_size * self.encoder.window)
        return self._variants.get(**changes)


# --------------------------------------------------------------------------------------------------
def _check_unsupported(output_value, precision, pool, chunk_size, task) -> None:
    if output_value != "sentence_embedding":
        raise ValueError(f"output_value {output_value!r} is not supported; DICE returns 'sentence_embedding' only")
    if precision not in ("float32", None):
        raise ValueError(f"precision {precision!r} is not supported (float32 only); quantize afterwards, e.g. with "
                         "sentence_transformers.quantization.quantize_embeddings")
    if pool is not None:
        raise ValueError("multi-process pools are not supported: one encoder packs all texts itself")
    if chunk_size is not None:
        raise ValueError("chunk_size here is sentence-transformers' multi-process chunking, which is not supported; "
                         "DICE's chunk size is an encoder option: DiceSentenceEncoder(..., chunk_size=...)")
    if task not in _TASKS:
        raise ValueError(f"task must be one of {_TASKS}, got {task!r}")


def _device_type(device) -> str:
    return getattr(device, "type", None) or str(device).split(":")[0]


def _convert(vecs: np.ndarray, single: bool, to_numpy: bool, to_tensor: bool, device):
    import torch

    if to_tensor:
        out = torch.from_numpy(vecs).to(device)
        return out[0] if single else out
    if to_numpy:
        return vecs[0] if single else vecs
    rows = list(torch.from_numpy(vecs))
    return rows[0] if single else rows


def _similarity(name: str, a, b, pairwise: bool):
    """sentence-transformers' ``cos_sim`` / ``dot_score`` / ``euclidean_sim`` / ``manhattan_sim`` of (n1, d)
    and (n2, d) float32 tensors -> (n1, n2), or their ``pairwise_*`` twins of two (n, d) -> (n,)."""
    import torch

    if name == "cosine":
        a, b = torch.nn.functional.normalize(a, p=2, dim=1), torch.nn.functional.normalize(b, p=2, dim=1)
    if name in ("cosine", "dot"):
        return (a * b).sum(dim=-1) if pairwise else a @ b.T
    p = 2.0 if name == "euclidean" else 1.0
    return -torch.linalg.vector_norm(a - b, ord=p, dim=-1) if pairwise else -torch.cdist(a, b, p=p)


def _rows(x):
    import torch

    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        t = torch.stack([r.detach().float() for r in x])
    else:
        t = x.detach().float() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x, np.float32))
    return t[None] if t.ndim == 1 else t
