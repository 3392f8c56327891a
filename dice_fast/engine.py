"""The engine: many documents in, one DICE vector per document out.

    texts --tokenize--> TokenizedDocuments --plan_chunks--> ChunkPlan
          --pack (token budget)--> PackedBatch: input_ids, position_ids, cu_seqlens, max_seqlen
          --frozen HF model with dice_fast varlen attention--> hidden (T, H)
          --pool_chunks--> chunk vectors (fp32) --aggregate_documents--> document vectors
          --> rows in input order

Chunk vectors of a group of documents are gathered in one float32 buffer before any document is
aggregated, so a document whose chunks fall into several packed batches gets exactly the vector it
would get in one; groups hold whole documents and bound memory on very large inputs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from . import attention as attn
from .chunking import ChunkPlan, TokenizedDocuments, check_texts, plan_chunks, tokenize
from .config import DEFAULT_CHUNK_SIZE, DiceConfig
from .models import ModelSpec, inspect_model, load_model
from .ops import aggregate_documents, pool_chunks, resolve_impl
from .packing import PackedBatch, batch_ranges, pack, wrapped_lengths

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU: activations of a 4k-token batch stay in cache; MiniLM, 40 mixed documents on the 2-core EPYC:
# fp32 6.5 s at 4096 vs 7.4 s at 16384 tokens (padded baseline 7.5 s); bf16 3.9 vs 4.5 s.
_DEFAULT_BATCH_TOKENS = {"cpu": 4096, "cuda": 65536}
_GROUP_BATCHES = 64  # documents are aggregated every ~64 batches' worth of tokens


@dataclass(frozen=True)
class DiceOutput:
    """Result of ``encode_documents(..., return_chunks=True)``.

    documents: (n_docs, dim) float32, row i is texts[i].
    chunks: (n_chunks, dim) float32 chunk vectors as aggregated (L2-normalised when
        ``normalize_chunks``); chunks of a document are contiguous and in document order.
    chunk_document: (n_chunks,) int64 document index of each chunk.
    chunk_start, chunk_end: (n_chunks,) int64 the chunk's content span ``[start, end)`` in its
        document's tokens (tokenized without special tokens).
    document_tokens: (n_docs,) int64 token count of every document.
    """

    documents: np.ndarray
    chunks: np.ndarray
    chunk_document: np.ndarray
    chunk_start: np.ndarray
    chunk_end: np.ndarray
    document_tokens: np.ndarray


class DiceEncoder:
    """Packed, exact DICE encoder around a frozen Hugging Face model.

    ``DiceEncoder(model, tokenizer, **options)`` wraps a loaded model (kept on its device and in its
    dtype unless ``device``/``dtype`` say otherwise); `from_pretrained` loads one. Options are the
    fields of `DiceConfig` (see README.md); ``config=`` may pass a whole `DiceConfig` instead.
    """

    def __init__(self, model, tokenizer, config: DiceConfig | None = None, *, model_path: str | None = None, **options):
        if config is not None and options:
            raise TypeError("pass either config= or keyword options, not both")
        _check_option_names(options)
        if isinstance(options.get("dtype"), torch.dtype):
            options["dtype"] = str(options["dtype"]).replace("torch.", "")
        cfg = config or DiceConfig(**options)

        param = next(model.parameters())
        device = torch.device(cfg.device) if cfg.device is not None else param.device
        dtype = _DTYPES[cfg.dtype] if cfg.dtype is not None else param.dtype
        if device != param.device or dtype != param.dtype:
            model.to(device=device, dtype=dtype)
        model.eval().requires_grad_(False)
        self.model, self.tokenizer = model, tokenizer
        self.spec: ModelSpec = inspect_model(model, tokenizer, model_path)
        self.device, self.dtype = device, dtype
        self.backend = attn.choose_backend(cfg.attention_backend, device, dtype)
        self.pooling_impl = resolve_impl(cfg.pooling_impl, device)
        attn.register()

        window = cfg.max_length if cfg.max_length is not None else self.spec.window
        if window > self.spec.position_limit:
            raise ValueError(f"max_length {window} exceeds the model's {self.spec.position_limit} positions")
        specials = len(self.spec.special_prefix) + len(self.spec.special_suffix)
        self._doc_prefix = self._wrap_ids(cfg.document_prefix)
        self._query_prefix = self._wrap_ids(cfg.query_prefix)
        doc_overhead = specials + len(self._doc_prefix[0]) - len(self.spec.special_prefix)
        if window - doc_overhead < 1:
            raise ValueError(f"the model window of {window} tokens leaves no room for text beside {doc_overhead} special/prefix tokens")
        if cfg.chunk_size is None:
            cfg = cfg.replace(chunk_size=max(min(DEFAULT_CHUNK_SIZE, window - doc_overhead), cfg.overlap + 1))
        if cfg.chunk_size + doc_overhead > self.spec.position_limit:
            raise ValueError(
                f"chunk_size {cfg.chunk_size} plus {doc_overhead} special/prefix tokens is "
                f"{cfg.chunk_size + doc_overhead} tokens, more than the model's {self.spec.position_limit} "
                f"positions; allowed: chunk_size <= {self.spec.position_limit - doc_overhead}"
            )
        self.config = cfg
        self.window = window
        self.pooling = cfg.pooling or self.spec.pooling
        self.normalize_chunks = self.spec.normalizes if cfg.normalize_chunks is None else cfg.normalize_chunks
        self.max_batch_tokens = cfg.max_batch_tokens or _DEFAULT_BATCH_TOKENS.get(device.type, 16384)
        self.causal = {"model default": None, "causal": True, "bidirectional": False}[cfg.attention]

    @classmethod
    def from_pretrained(cls, path=None, *, trust_remote_code: bool = False, **options) -> DiceEncoder:
        """Load a model folder (``None``: the bundled all-MiniLM-L6-v2) and wrap it.

        ``device`` defaults to CUDA when available (bfloat16) else CPU (float32).
        """
        _check_option_names(options)
        device = torch.device(options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = options.get("dtype") or ("bfloat16" if device.type == "cuda" else "float32")
        dtype = str(dtype).replace("torch.", "")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        DiceConfig(**{**options, "device": str(device), "dtype": dtype})  # fail on bad options before loading
        model, tokenizer = load_model(path, device, _DTYPES[dtype], trust_remote_code)
        from .models import default_model_path

        model_path = str(path) if path is not None else default_model_path()
        return cls(model, tokenizer, model_path=model_path, **{**options, "device": str(device), "dtype": dtype})

    # ----------------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        """Width of the returned vectors."""
        return self.spec.hidden_size

    @property
    def chunk_wrapping(self) -> tuple[np.ndarray, np.ndarray]:
        """(prefix ids, suffix ids) int64 put around every chunk: special prefix + document prefix, special suffix."""
        return self._doc_prefix

    @property
    def chunk_overhead(self) -> int:
        """Tokens every chunk carries besides its text (special tokens and document prefix)."""
        return self._overhead(self._doc_prefix)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"DiceEncoder(model={self.spec.name!r}, device={self.device}, dtype={str(self.dtype).replace('torch.', '')}, "
            f"attention={self.backend}{'' if self.causal is None else ('/causal' if self.causal else '/bidirectional')}, "
            f"pooling_impl={self.pooling_impl}, strategy={c.strategy}, chunk_size={c.chunk_size}, overlap={c.overlap}, "
            f"positions={c.positions}, pooling={self.pooling}, aggregation={c.aggregation}, window={self.window}, "
            f"max_batch_tokens={self.max_batch_tokens})"
        )

    # ----------------------------------------------------------------------------------------
    def encode_documents(self, texts: Iterable[str], return_chunks: bool = False, show_progress: bool = False,
                         progress: Callable[[int, int], None] | None = None):
        """Encode documents. texts: n_docs strings.

        Returns (n_docs, dim) float32 (row i is texts[i]), or a `DiceOutput` when ``return_chunks``.
        ``show_progress`` draws a bar (documents, tokens, tokens/s); ``progress(documents, tokens)``
        is instead called with the documents finished and tokens encoded since its last call.
        """
        texts = check_texts(texts, "documents")
        c = self.config
        if c.strategy == "single":
            size, cap = self.window - self._overhead(self._doc_prefix), 1
        else:
            size, cap = c.chunk_size, c.max_chunks_per_document
        with _progress(show_progress, progress, len(texts)) as report:
            return self._encode(
                texts, self._doc_prefix, size, c.overlap if c.strategy == "dice" else 0, cap,
                aggregation=c.aggregation, global_positions=c.positions == "global" and c.strategy == "dice",
                return_chunks=return_chunks, progress=report, what="documents",
            )

    def encode_queries(self, texts: Iterable[str], show_progress: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Encode queries, one window each (never chunked). texts: n strings -> (n, dim) float32.

        A query longer than the model window is cut to it, with a warning naming it.
        """
        texts = check_texts(texts, "queries")
        size = self.window - self._overhead(self._query_prefix)
        with _progress(show_progress, progress, len(texts)) as report:
            return self._encode(
                texts, self._query_prefix, size, 0, 1, aggregation="mean", global_positions=False,
                return_chunks=False, progress=report, what="queries", warn_truncated=True,
            )

    # ----------------------------------------------------------------------------------------
    def _wrap_ids(self, text_prefix: str) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tokenizer(text_prefix, add_special_tokens=False)["input_ids"] if text_prefix else []
        prefix = np.asarray(list(self.spec.special_prefix) + list(ids), dtype=np.int64)
        return prefix, np.asarray(self.spec.special_suffix, dtype=np.int64)

    @staticmethod
    def _overhead(wrap) -> int:
        return len(wrap[0]) + len(wrap[1])

    def _encode(self, texts, wrap, chunk_size, overlap, max_chunks, *, aggregation, global_positions,
                return_chunks, progress, what, warn_truncated=False):
        docs = tokenize(self.tokenizer, texts, what=what)
        plan = plan_chunks(docs.lengths, chunk_size, overlap, max_chunks)
        if warn_truncated:
            _warn_truncated(docs.lengths, chunk_size, self.window, what)
        if global_positions:
            self._check_global_positions(plan, wrap)
        lengths = wrapped_lengths(plan, len(wrap[0]), len(wrap[1]))
        doc_parts, chunk_parts = [], []
        with _attention_swapped(self.model):
            for d_lo, d_hi in _document_groups(plan, lengths, self.max_batch_tokens * _GROUP_BATCHES):
                d, ch = self._encode_group(docs, plan, lengths, wrap, d_lo, d_hi, aggregation,
                                           global_positions, progress)
                doc_parts.append(d)
                if return_chunks:
                    chunk_parts.append(ch)
        dim = self.dim
        documents = np.concatenate(doc_parts) if doc_parts else np.zeros((0, dim), np.float32)
        if not return_chunks:
            return documents
        chunks = np.concatenate(chunk_parts) if chunk_parts else np.zeros((0, dim), np.float32)
        return DiceOutput(
            documents=documents,
            chunks=chunks,
            chunk_document=plan.document.copy(),
            chunk_start=plan.start.copy(),
            chunk_end=plan.start + plan.length,
            document_tokens=docs.lengths.copy(),
        )

    def _encode_group(self, docs, plan, lengths, wrap, d_lo, d_hi, aggregation, global_positions, progress):
        c_lo, c_hi = int(plan.cu_doc_chunks[d_lo]), int(plan.cu_doc_chunks[d_hi])
        chunk_vecs = torch.zeros((c_hi - c_lo, self.dim), dtype=torch.float32, device=self.device)
        batches = [ids + c_lo for ids in batch_ranges(lengths[c_lo:c_hi], self.max_batch_tokens)]
        docs_reported = d_lo
        for batch, tensors in _prefetch(batches, lambda ids: self._prepare(docs, plan, ids, wrap, global_positions),
                                        threaded=self.device.type == "cuda"):
            pooled = self._forward_pool(batch, tensors)
            chunk_vecs.index_copy_(0, tensors["chunk_index"] - c_lo, pooled)
            if progress is not None:
                done = int(np.searchsorted(plan.cu_doc_chunks, int(batch.chunk_ids.max()) + 1, side="right")) - 1
                progress(done - docs_reported, batch.n_tokens)
                docs_reported = done
        if progress is not None and d_hi > docs_reported:  # documents with no tokens to run
            progress(d_hi - docs_reported, 0)
        cu_docs = torch.from_numpy(plan.cu_doc_chunks[d_lo : d_hi + 1] - c_lo).to(self.device)
        weights = torch.from_numpy(lengths[c_lo:c_hi].astype(np.float32)).to(self.device)
        c = self.config
        documents = aggregate_documents(
            chunk_vecs, cu_docs, weights, aggregation, c.top_k, c.temperature,
            self.normalize_chunks, c.normalize, impl=self.pooling_impl,
        )
        chunks_out = chunk_vecs
        if self.normalize_chunks:
            chunks_out = torch.nn.functional.normalize(chunk_vecs, dim=1, eps=1e-12)
        return documents.cpu().numpy(), chunks_out.cpu().numpy()

    def _prepare(self, docs, plan, chunk_ids, wrap, global_positions):
        """Pack one batch and move it to the device (runs in a background thread on CUDA)."""
        batch = pack(docs, plan, chunk_ids, wrap[0], wrap[1], self.spec.first_position, global_positions)
        pin = self.device.type == "cuda"

        def dev(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            if pin:
                t = t.pin_memory()
            return t.to(self.device, non_blocking=True)

        tensors = {
            "input_ids": dev(batch.input_ids),
            "position_ids": dev(batch.position_ids),
            "cu_seqlens": dev(batch.cu_seqlens),
            "chunk_index": dev(batch.chunk_ids),
        }
        return batch, tensors

    def _forward_pool(self, batch: PackedBatch, t: dict) -> torch.Tensor:
        """One packed forward; returns (n_chunks_in_batch, dim) float32 chunk vectors in packing order."""
        with torch.inference_mode(), attn.attention_context(self.backend, self.causal, batch.lengths, batch.cu_seqlens):
            out = self.model(
                input_ids=t["input_ids"].unsqueeze(0),
                position_ids=t["position_ids"].unsqueeze(0),
                cu_seq_lens_q=t["cu_seqlens"],
                cu_seq_lens_k=t["cu_seqlens"],
                max_length_q=batch.max_seqlen,
                max_length_k=batch.max_seqlen,
                use_cache=False,
            )
            hidden = out.last_hidden_state[0]
            return pool_chunks(hidden, t["cu_seqlens"], self.pooling, impl=self.pooling_impl)

    def _check_global_positions(self, plan: ChunkPlan, wrap) -> None:
        last = plan.start + plan.length + self._overhead(wrap)  # positions used, per chunk
        bad = np.flatnonzero(last > self.spec.position_limit)
        if len(bad):
            d = int(plan.document[bad[0]])
            raise ValueError(
                f"positions='global' needs {int(last[bad[0]])} positions for document {d}, but the model has "
                f"{self.spec.position_limit}; use positions='local' or max_chunks_per_document"
            )


# --------------------------------------------------------------------------------------------
def _check_option_names(options: dict) -> None:
    unknown = set(options) - set(DiceConfig.field_names())
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; allowed: {', '.join(DiceConfig.field_names())}")


class _attention_swapped:
    """Route the model's attention through dice_fast's varlen function for the duration of a call."""

    def __init__(self, model):
        self.config = model.config

    def __enter__(self):
        self.saved = self.config._attn_implementation
        self.config._attn_implementation = attn.ATTENTION_NAME

    def __exit__(self, *exc):
        self.config._attn_implementation = self.saved


def _document_groups(plan: ChunkPlan, lengths: np.ndarray, group_tokens: int) -> Iterator[tuple[int, int]]:
    """Consecutive ranges of whole documents of about ``group_tokens`` wrapped tokens each."""
    if plan.n_docs == 0:
        return
    doc_tokens = np.add.reduceat(lengths, plan.cu_doc_chunks[:-1]) if plan.n_chunks else np.zeros(plan.n_docs)
    cum = np.cumsum(doc_tokens)
    lo, base = 0, 0
    while lo < plan.n_docs:
        hi = max(int(np.searchsorted(cum, base + group_tokens, side="right")), lo + 1)
        yield lo, hi
        base = int(cum[hi - 1])
        lo = hi


def _prefetch(items: list, prepare, threaded: bool):
    """Yield ``prepare(item)`` for each item; when ``threaded``, item i+1 is prepared while i is used."""
    if not threaded:
        for item in items:
            yield prepare(item)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(prepare, items[0]) if items else None
        for i in range(len(items)):
            result = future.result()
            future = pool.submit(prepare, items[i + 1]) if i + 1 < len(items) else None
            yield result


def _warn_truncated(doc_lengths: np.ndarray, capacity: int, window: int, what: str) -> None:
    over = np.flatnonzero(doc_lengths > capacity)
    if len(over):
        first = ", ".join(f"{what}[{i}] ({int(doc_lengths[i])} tokens)" for i in over[:3])
        warnings.warn(
            f"{len(over)} {what} longer than the model window ({window} tokens with special tokens) "
            f"were cut to their first {capacity} tokens: {first}{' ...' if len(over) > 3 else ''}",
            stacklevel=3,
        )


class ProgressBar:
    """A tqdm bar over documents that also shows tokens and tokens/s; call it with increments.

    ``tokens`` counts the tokens reported so far, also when the bar is hidden (``show=False``).
    """

    def __init__(self, n_docs: int, desc: str | None = None, show: bool = True):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=n_docs, unit="doc", dynamic_ncols=True, desc=desc, disable=not show)
        self.tokens, self.t0 = 0, time.perf_counter()

    def __call__(self, docs: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens:,} tokens, {rate:,.0f} tok/s", refresh=False)
        self.bar.update(docs)

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def _progress(show: bool, callback, n_docs: int):
    """The caller's callback, else a bar of our own (closed on exit) when asked for, else None."""
    if callback is not None or not (show and n_docs):
        yield callback
        return
    bar = ProgressBar(n_docs)
    try:
        yield bar
    finally:
        bar.close()
