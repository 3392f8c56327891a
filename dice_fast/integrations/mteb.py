"""dice_fast as an MTEB model (the MTEB 2.x encoder protocol): corpus documents through DICE, queries
one model window each, prompts per task / task type / query-or-document.

    import mteb
    from dice_fast.integrations.mteb import DiceMTEBModel
    model = DiceMTEBModel(None, chunk_size=254, aggregation="mean")     # bundled MiniLM; or a folder / a DiceEncoder
    results = mteb.evaluate(model, mteb.get_tasks(tasks=["LEMBPasskeyRetrieval"]))

MTEB calls ``encode(dataloader, task_metadata=..., prompt_type=...)``: ``prompt_type`` query -> queries
(`DiceEncoder.encode_queries`, never chunked), document -> documents (`encode_documents`, DICE);
tasks without a prompt type (STS, classification, clustering ...) are encoded as documents, which for
texts of at most ``chunk_size`` tokens is the single-window vector (to float rounding). The loader's
``batch_size`` only sizes MTEB's DataLoader: the engine packs every text of a call under its own
``max_batch_tokens``.

Prompts (``prompts={...}``, default: the model folder's sentence-transformers prompts) are looked up
in MTEB's order: ``"{task name}-{query|document}"``, ``"{task name}"``, ``"{task type}-{query|document}"``,
``"{task type}"``, ``"query"`` / ``"document"``. The prompt found becomes the ``query_prefix`` or
``document_prefix`` of that call (its tokens follow the special prefix of every chunk); none found ->
the encoder's own prefixes (none for a folder loaded here; a `DiceEncoder` passed in keeps its own).
A task's own instruction (``TaskMetadata.prompt``) is not used.

Needs the ``mteb`` extra: ``pip install dice-fast[mteb]``.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from ..errors import require
from ..runinfo import model_label
from ._common import Variants, as_encoder, model_prompts, vector_settings

__all__ = ["DiceMTEBModel"]

# MTEB keeps a run's results under name / revision / experiment name, the experiment name being made
# from ``experiment_kwargs``: these options are named there readably, and an ``options`` digest of
# everything that shapes a vector (`DiceMTEBModel.experiment_options`) keeps apart runs that differ in
# anything else, so a cached result is never another configuration's
_NAMED_OPTIONS = ("strategy", "chunk_size", "overlap", "aggregation", "pooling", "dtype")
_DIGEST_HEX = 12


class DiceMTEBModel:
    """An MTEB encoder over a `DiceEncoder`.

    encoder: a `DiceEncoder`, a local model folder, or None (the bundled all-MiniLM-L6-v2); a folder or
        None is loaded with ``options`` (`DiceConfig` fields).
    prompts: ``{key: prompt}`` with MTEB's keys (see the module docstring); None reads the model
        folder's ``config_sentence_transformers.json`` prompts.
    name: the model name MTEB records (``"org/model"``; default ``"dice_fast/<model folder>"``).
    """

    def __init__(self, encoder=None, prompts: dict[str, str] | None = None, *, name: str | None = None, **options):
        require("mteb", extra="mteb", needed_by="DiceMTEBModel")
        self.encoder = as_encoder(encoder, options, applies_prompts=True)
        self._variants = Variants(self.encoder)
        self.model_prompts = dict(model_prompts(self.encoder)[0] if prompts is None else prompts)
        self.name = name or f"dice_fast/{model_label(self.encoder.spec.name)}"
        self._meta = None

    @property
    def experiment_options(self) -> dict:
        """Everything that shapes this model's vectors, resolved: `vector_settings` of the encoder (every
        `DiceConfig` option of role "vector" or "precision", the late-chunking windows, the width ...) and
        the prompts. Its digest is the ``options`` entry of the MTEB experiment name."""
        options = vector_settings(self.encoder)
        options["prompts"] = dict(sorted(self.model_prompts.items()))
        return options

    @property
    def mteb_model_meta(self):
        """The `mteb.models.ModelMeta` of this model (name, dimension, cosine similarity, DICE options).

        Its ``experiment_kwargs`` (what MTEB names a run's results folder by) hold the main options
        readably and ``options``: a digest of `experiment_options`, so that runs with other prompts,
        prefixes, ``truncate_dim``, ``normalize`` or any other option that changes a vector never share
        MTEB's cached results."""
        options = self.experiment_options
        blob = json.dumps(options, sort_keys=True, default=str).encode("utf-8")
        digest = hashlib.sha256(blob).hexdigest()[:_DIGEST_HEX]
        if self._meta is None or self._meta[0] != digest:
            from mteb.models import ModelMeta

            import dice_fast

            c = self.encoder.config
            named = {k: options[k] for k in _NAMED_OPTIONS}
            named["dtype"] = c.dtype  # readable; the precision's full identity is in the digest
            if c.aggregation == "topk_norm":
                named["top_k"] = c.top_k
            if c.aggregation == "softmax_norm":
                named["temperature"] = c.temperature
            if c.max_chunks_per_document is not None:
                named["max_chunks_per_document"] = c.max_chunks_per_document
            if c.strategy == "late":
                named.update(window_tokens=options["window_tokens"], window_overlap=options["window_overlap"])
            named["options"] = digest
            self._meta = (digest, ModelMeta.create_empty({
                "name": self.name,
                "revision": f"dice_fast-{dice_fast.__version__}",
                "embed_dim": self.encoder.dim,
                "n_parameters": sum(p.numel() for p in self.encoder.model.parameters()),
                "similarity_fn_name": _cosine(),
                "framework": ["PyTorch", "Transformers"],
                "use_instructions": bool(self.model_prompts),
                "experiment_kwargs": named,
            }))
        return self._meta[1]

    def encode(self, inputs, *, task_metadata, hf_split: str | None = None, hf_subset: str | None = None,
               prompt_type=None, **kwargs) -> np.ndarray:
        """(n, dim) float32 vectors of every text of ``inputs`` (an MTEB DataLoader of ``{"text": [...]}``
        batches), in order: queries for ``prompt_type`` query, documents (DICE) otherwise."""
        texts: list[str] = []
        for batch in inputs:
            texts.extend(batch["text"])
        kind = getattr(prompt_type, "value", prompt_type)
        prompt = self.get_prompt(task_metadata, prompt_type)
        show = bool(kwargs.get("show_progress_bar", False))
        if kind == "query":
            return self._variants.get(**_prefix("query_prefix", prompt)).encode_queries(texts, show_progress=show)
        return self._variants.get(**_prefix("document_prefix", prompt)).encode_documents(texts, show_progress=show)

    def get_prompt(self, task_metadata, prompt_type) -> str | None:
        """The prompt for this task and prompt type, in MTEB's order of precedence; None if none applies."""
        kind = getattr(prompt_type, "value", prompt_type)
        task_type = getattr(task_metadata, "type", None)
        task_name = getattr(task_metadata, "name", None)
        candidates = [f"{task_name}-{kind}" if task_name and kind else None, task_name,
                      f"{task_type}-{kind}" if task_type and kind else None, task_type, kind]
        for key in candidates:
            if key and key in self.model_prompts:
                return self.model_prompts[key]
        return None

    def similarity(self, embeddings1, embeddings2):
        """(n1, n2) cosine similarity, float32 torch tensor."""
        import torch

        a, b = _tensor(embeddings1), _tensor(embeddings2)
        return torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(b, dim=1).T

    def similarity_pairwise(self, embeddings1, embeddings2):
        """(n,) cosine similarity of row i with row i, float32 torch tensor."""
        import torch

        return torch.nn.functional.cosine_similarity(_tensor(embeddings1), _tensor(embeddings2), dim=1)

    def __repr__(self) -> str:
        return f"DiceMTEBModel({self.encoder!r}, name={self.name!r})"


def _cosine():
    """MTEB's cosine scoring enum (a plain "cosine" draws pydantic warnings when results are saved)."""
    try:
        from mteb.models.model_meta import ScoringFunction
    except ImportError:  # pragma: no cover - another mteb layout
        return "cosine"
    return ScoringFunction.COSINE


def _prefix(field: str, prompt: str | None) -> dict:
    return {} if prompt is None else {field: prompt}


def _tensor(x):
    import torch

    t = x.detach().float() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x, np.float32))
    return t[None] if t.ndim == 1 else t
