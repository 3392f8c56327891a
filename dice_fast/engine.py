"""The engine: many documents in, one DICE vector per document out.

    texts --plan (tokenize, chunk: chunking.py)--> EncodingPlan
          --ChunkQueue (token-budget batches, first in first out: chunk_queue.py; reuse/)--> PackedBatch
          --ModelRunner (packed varlen attention, or the exact padded fallback: runner.py)--> chunk vectors (fp32)
          --aggregate (aggregation.py)--> document vectors, rows in input order

The options are resolved once, with the model's facts, into `Settings` (settings.py); every stage
reads those (docs/architecture.md draws the whole flow).

Input is read as a stream: windows of whole documents are tokenized in a worker thread while the
model runs the previous window, and batches run across window boundaries, so memory stays bounded
by the window, not the corpus. A document's chunks are gathered before it is aggregated, so a
document whose chunks fall into several packed batches gets exactly the vector it would get in one.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from . import cpu_attention
from .aggregation import non_finite_document
from .chunk_queue import ChunkQueue
from .chunking import (EncodingPlan, TokenizedDocuments, check_texts, check_vocabulary, plan_chunks, plan_windows,
                       tokenize, warn_truncated)
from .config import DiceConfig, dtype_name
from .cpu_heap import keep_freed_pages, release_freed_memory
from .errors import ArgumentTypeError, NonFiniteOutput, TextError
from .models import inspect_model, load_model
from .output import DiceOutput, concat_outputs  # noqa: F401 - DiceOutput is part of the engine's API
from .packing import PackedBatch
from .pipeline import BatchPipeline
from .pieces import PIECE_CHARS, cuts_are_exact, tokenize_bounded
from .private_tokenizer import lowercasing, private_tokenizer
from .progress import progress_reporter
from .reuse import ChunkStats, MemoryCache
from .reuse.manager import ChunkReuse
from .reuse.persistent import settings_namespace
from .runner import ModelRunner
from .settings import (WEIGHT_DTYPES, Settings, check_kind, placement, precision_name, pretrained_placement,
                       refuse_openvino_off_cpu, resolve, weight_dtype)
from .streaming import Prefetch, as_iterator, windows

_WINDOW_BATCHES = 16  # a streaming window holds about 16 batches' worth of text
_CHARS_PER_TOKEN = 4  # to size windows before tokenizing (a window is cut by characters and documents)
_WINDOW_DOCUMENTS = 8192
# vectors kept per call so that identical chunks in different windows run once (~40k 384-d chunks)
_CALL_MEMORY_BYTES = 64 << 20
_SHOWN = ("strategy", "chunk_size", "overlap", "positions", "pooling", "aggregation", "max_length", "normalize_chunks",
          "window_tokens", "window_overlap")  # by __repr__, as resolved


class DiceEncoder:
    """Packed, exact DICE encoder around a frozen Hugging Face model.

    ``DiceEncoder(model, tokenizer, **options)`` wraps a loaded model; `from_pretrained` loads one.
    Options are the fields of `DiceConfig` (see README.md); ``config=`` may pass a whole `DiceConfig`.

    ``cache``: a folder (or an open `dice_fast.ChunkCache`) holding the persistent chunk cache:
    chunks found there are not run again, new ones are added (docs/reuse.md); ``cache_max_gb`` bounds
    it. Identical chunks within one call run once, cache or not, unless ``dedup=False``;
    ``chunk_stats`` counts chunks computed, deduplicated and served from memory or the cache.

    Construction puts the caller's model in eval mode without gradients, moves it to ``device`` /
    ``dtype`` when they are given, and points its config's attention implementation at dice_fast's
    function, which computes exactly the original attention outside dice_fast's own forwards (or,
    for a model that cannot run packed, leaves the config as it was). After that nothing is changed
    per call: any number of threads may encode with one encoder at once, each getting the vectors
    of a call made alone. On a CPU the first encoder also sets the process's glibc heap thresholds
    so activation pages are reused between operations (`dice_fast.cpu_heap`;
    ``DICE_FAST_CPU_HEAP=default`` keeps glibc's defaults).
    """

    def __init__(self, model, tokenizer, config: DiceConfig | None = None, *, model_path: str | None = None,
                 cache=None, cache_max_gb: float | None = None, **options):
        if config is not None and options:
            raise ArgumentTypeError("pass either config= or keyword options, not both")
        DiceConfig.check_names(options)
        if isinstance(options.get("dtype"), torch.dtype):
            options["dtype"] = dtype_name(options["dtype"])
        cfg = config or DiceConfig(**options)
        self.path_choice = None  # dice_fast.cpu_paths.PathChoice of dtype="auto" / compile="auto"
        if cfg.dtype == "auto" or cfg.compile == "auto":
            from .cpu_paths import resolve as resolve_path

            cfg, self.path_choice = resolve_path(type(self), model, tokenizer, cfg, model_path)

        param = next(model.parameters())
        device, dtype = placement(cfg, param.device, param.dtype)
        if device != param.device or dtype != param.dtype:
            model.to(device=device, dtype=dtype)
        model.eval().requires_grad_(False)
        if device.type == "cpu":
            keep_freed_pages()
        self.model, self.tokenizer, self.model_path = model, tokenizer, model_path  # model_path: its folder, or None
        # what it tokenizes with, one call at a time: its own copy (the caller's may be in use meanwhile)
        tok, self._tokenizer_lock = private_tokenizer(tokenizer)
        self.engine_tokenizer = tok
        self._cuts_exact: bool | None = None  # `cuts_are_exact`, probed on first use
        spec = inspect_model(model, tok, model_path)
        self.settings: Settings = resolve(cfg, spec, lowercasing(tok) if spec.lowercase else tok, device, dtype)
        s = self.settings
        self.chunk_stats = ChunkStats()
        if cfg.openvino:
            from .quant import openvino_runner

            self.runner = openvino_runner(self, model, tokenizer.pad_token_id)
        else:
            self.runner = ModelRunner(model, s.spec, s.backend, s.causal, s.pooling, s.pooling_impl,
                                      s.max_batch_tokens, tokenizer.pad_token_id, compile=cfg.compile == "on")
        if cfg.cuda_graphs:
            from .graphs import use_cuda_graphs

            use_cuda_graphs(self, capture=True)
        self.cache = (None if cache is None else
                      settings_namespace(s, model, cache, cache_max_gb, model_path, precision=self.precision))

    @classmethod
    def from_pretrained(cls, path=None, *, trust_remote_code: bool = False, cache=None,
                        cache_max_gb: float | None = None, **options) -> DiceEncoder:
        """Load a model folder (``None``: the bundled all-MiniLM-L6-v2) and wrap it.

        ``device`` defaults to CUDA when available (bfloat16) else CPU (float32); ``cache`` and
        ``cache_max_gb`` as for the constructor. A folder that holds no loadable model raises
        `dice_fast.errors.ModelError` naming it.
        """
        DiceConfig.check_names(options)
        device, dtype = pretrained_placement(options.get("device"), options.get("dtype"), options.get("runtime"))
        cfg = DiceConfig(**{**options, "device": str(device), "dtype": dtype})  # fail on bad options before loading
        refuse_openvino_off_cpu(cfg.openvino, device)  # before the model loads onto a GPU
        model, tokenizer = load_model(path, device, weight_dtype(cfg, WEIGHT_DTYPES[dtype]), trust_remote_code)
        from .models import default_model_path

        model_path = str(path) if path is not None else default_model_path()
        return cls(model, tokenizer, model_path=model_path, cache=cache, cache_max_gb=cache_max_gb,
                   **{**options, "device": str(device), "dtype": dtype})

    # ---------------------------------------------------------------- the resolved settings, by name
    config = property(lambda self: self.settings.config, doc="The `DiceConfig`, ``chunk_size`` resolved.")
    spec = property(lambda self: self.settings.spec, doc="The model's `ModelSpec`.")
    device = property(lambda self: self.settings.device, doc="Where the model runs.")
    dtype = property(lambda self: self.settings.dtype, doc="The model's precision.")
    window = property(lambda self: self.settings.window, doc="Tokens of a model window, specials included.")
    pooling = property(lambda self: self.settings.pooling, doc="Token -> chunk pooling.")
    pooling_impl = property(lambda self: self.settings.pooling_impl, doc="The pooling kernels that run.")
    normalize_chunks = property(lambda self: self.settings.normalize_chunks,
                                doc="Whether chunk vectors are L2-normalised before aggregating.")
    max_batch_tokens = property(lambda self: self.settings.max_batch_tokens, doc="Token budget of a forward.")
    causal = property(lambda self: self.settings.causal, doc="None (the model's own attention), True or False.")

    # ----------------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        """Width of the returned vectors: ``truncate_dim``, else the model's (its head's, if any)."""
        return self.settings.dim

    @property
    def backend(self) -> str:
        """The attention that runs: "flash_attn", "torch_varlen", "sdpa_groups" (packed) or "padded"."""
        return self.runner.backend

    @property
    def precision(self) -> str:
        """What chunk vectors are computed in: "float32" ("float32 (matmuls in tf32)": `precision_name`),
        "bfloat16", "float16", or the OpenVINO model's identity (precision, versions, model and int8
        calibration hashes); the chunk cache's key."""
        return getattr(self.runner, "identity", None) or precision_name(self.dtype, self.device)

    @property
    def chunk_overhead(self) -> int:
        """Tokens every chunk carries besides its text (special tokens and document prefix)."""
        return self.settings.chunk_overhead

    def __repr__(self) -> str:
        c, s = self.config, self.settings
        backend = self.backend
        if self.runner.fallback_reason:
            backend += f" (model's own attention: {self.runner.fallback_reason})"
        elif self.runner.packed_limit is not None:
            backend += f" (padded for chunks over the {self.runner.packed_limit}-token sliding window)"
        return (
            f"DiceEncoder(model={self.spec.name!r}, device={self.device}, dtype={self.precision}, "
            f"attention={backend}{'' if self.causal is None else ('/causal' if self.causal else '/bidirectional')}, "
            f"pooling_impl={self.pooling_impl}, strategy={c.strategy}, chunk_size={c.chunk_size}, overlap={c.overlap}, "
            f"positions={c.positions}, pooling={s.pooling_label()}, aggregation={c.aggregation}, window={self.window}, "
            f"max_batch_tokens={self.max_batch_tokens}, normalize_chunks={s.normalize_chunks}{s.head_label()}"
            f"{s.late_label()}{c.changed((*DiceConfig.options_of('vector'), 'dedup'), shown=_SHOWN)}"
            f"{self._speed_label()})"
        )

    def _speed_label(self) -> str:
        """Where they apply: ", cpu_attention=bf16 amx, cpu_linear=onednn (6 with gelu)" (CPU forward), ", compile=on (...)", ", path=..."."""
        torch_cpu = self.device.type == "cpu" and getattr(self.runner, "identity", None) is None
        out = (cpu_attention.label(self.dtype) + self.runner.cpu_label()) if torch_cpu else ""
        if self.runner.compiled is not None:
            out += ", compile=on" + (f" (compiled in {t:.1f} s)" if (t := self.runner.compiled.compile_seconds) is not None else "")
        if self.path_choice is not None:
            out += f", path={self.path_choice}"
        return out

    # ----------------------------------------------------------------------------------------
    def plan(self, texts: Iterable[str], kind: str = "documents", strategy: str | None = None) -> EncodingPlan:
        """Tokenize ``texts`` (n strings) and plan their chunks exactly as the engine will encode them.

        kind: "documents" (chunked by the encoder's options) or "queries" (one window each, never
        chunked; a query longer than the window is cut to it with a warning naming it). strategy: for
        this plan only (None: the encoder's; "single": one window of each document, "late": late
        chunking's windows); plans of every strategy run through one queue of this encoder together.
        """
        return self._plan(check_texts(texts, check_kind(kind)), kind, strategy=strategy)

    def plan_tokens(self, tokens: TokenizedDocuments, kind: str = "documents", strategy: str | None = None) -> EncodingPlan:
        """`plan` for texts already tokenized (``tokens``: n texts' ids without special tokens, as
        ``self.tokenize(texts, kind=kind)`` gives them: after ``kind``'s prefix, which ``plan`` equals)."""
        return self._plan_tokens(tokens, check_kind(kind), strategy=strategy)

    def max_tokens_used(self, kind: str = "documents", strategy: str | None = None) -> int | None:
        """Most tokens of one text the model runs (special tokens and prefix aside); a longer text is
        cut to them: a query to one window, a document with ``strategy="single"`` or
        ``max_chunks_per_document``. None: every token runs."""
        c = self.settings.chunking(check_kind(kind), strategy)
        return None if c.cap is None else c.size + (c.cap - 1) * (c.size - c.overlap)

    def encode_documents(self, texts: Iterable[str], return_chunks: bool = False, show_progress: bool = False,
                         progress: Callable[[int, int], None] | None = None):
        """Encode documents. texts: any iterable of n_docs strings (a list, a generator, a file reader).

        Returns (n_docs, dim) float32 (row i is text i), or a `DiceOutput` when ``return_chunks``.
        ``show_progress`` draws a bar (tokens, documents, tokens/s); ``progress(documents, tokens)``
        is instead called with the documents finished and tokens encoded since its last call.
        A batch that runs out of memory is split and retried (`dice_fast.faults`); a chunk that runs
        out alone raises `dice_fast.faults.InputOutOfMemory` naming its document (``documents[i]``).
        """
        blocks = list(self.stream_documents(texts, return_chunks, show_progress, progress))
        return concat_outputs(blocks, self.dim, return_chunks)

    def stream_documents(self, texts: Iterable[str], return_chunks: bool = False, show_progress: bool = False,
                         progress: Callable[[int, int], None] | None = None) -> Iterator:
        """Encode documents as a stream, with memory bounded by a window of documents, not the corpus.

        texts: any iterable of strings, read ahead only as far as the next window. Yields, in input
        order, one (n_window, dim) float32 block per window (or a `DiceOutput` of the window when
        ``return_chunks``; its ``chunk_document`` counts from the window's first document).
        Tokenization of the next window overlaps the model's work on the current one.
        """
        texts = as_iterator(texts, "documents")
        size = self.max_batch_tokens * _WINDOW_BATCHES * _CHARS_PER_TOKEN
        with progress_reporter(show_progress, progress, None) as report:  # windows read here, planned in a worker
            yield from self._run(windows(texts, size, _WINDOW_DOCUMENTS), self.config.aggregation, return_chunks,
                                 report, plan=lambda w: self._plan(w[0], "documents", w[1], spans=return_chunks))

    def encode_queries(self, texts: Iterable[str], show_progress: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Encode queries, one window each (never chunked). texts: n strings -> (n, dim) float32.

        A query longer than the model window is cut to it, with a warning naming it.
        """
        plan = self._plan(check_texts(texts, "queries"), "queries", spans=False)
        with progress_reporter(show_progress, progress, None) as report:  # (repeats and cached queries run no tokens)
            return concat_outputs(list(self._run(iter([plan]), "mean", False, report, "queries")), self.dim, False)

    def run_batch(self, batch: PackedBatch) -> torch.Tensor:
        """Pooled chunk vectors (n_chunks, hidden_size) float32 of one packed batch, in packing order, before
        the model's head (`ChunkQueue.run` runs it)."""
        return self.runner.run(batch)

    def chunk_queue(self, max_batch_tokens: int | None = None, *, memory: MemoryCache | None = None,
                    stats: ChunkStats | None = None, dedup: bool | None = None) -> ChunkQueue:
        """A `ChunkQueue` of this encoder's settings and runner, reusing chunks through this encoder's
        persistent cache (if any) and ``memory`` (a `MemoryCache`, shared across queues if you pass one).
        stats: where reuse is counted (default: a new `ChunkStats`, as ``queue.stats``); dedup: reuse at
        all (default: the ``dedup`` option; False: every chunk runs); max_batch_tokens: the budget of a
        batch (default: the encoder's)."""
        enabled = self.config.dedup if dedup is None else dedup
        reuse = ChunkReuse(memory=memory, cache=self.cache, stats=stats, enabled=enabled)
        return ChunkQueue(self.settings, self.runner, reuse, max_batch_tokens)

    # ---------------------------------------------------------------- the tokenizer, one caller at a time
    def tokenize(self, texts: list[str], *, what: str = "texts", base: int = 0, spans: bool = True,
                 kind: str | None = None) -> TokenizedDocuments:
        """`dice_fast.chunking.tokenize` of ``texts`` (n strings): the ids without special tokens (and their
        character spans unless ``spans=False``) they have after the prefix of ``kind`` ("documents", "queries";
        None: none); with a text of over `PIECE_CHARS` characters, `tokenize_bounded`'s (where cuts are exact).
        Thread-safe: one call at a time reaches the tokenizer (fast tokenizers are not)."""
        after = self.settings.text_prefix(kind)
        if any(len(t) > PIECE_CHARS for t in texts) and self.cuts_are_exact():  # a huge text goes in pieces: whole,
            # the tokenizer's working memory is ~160 bytes a character (8 GB for one line of 50 MB)
            return tokenize_bounded(self.engine_tokenizer, texts, self._tokenizer_lock, piece_chars=PIECE_CHARS, what=what,
                                    base=base, after=after, exact=True)
        with self._tokenizer_lock:
            return tokenize(self.engine_tokenizer, texts, what=what, base=base, spans=spans, after=after)

    def tokenize_bounded(self, texts: list[str], *, piece_chars: int | None, check=None, enough: int | None = None,
                         what: str = "texts", kind: str | None = None) -> TokenizedDocuments:
        """`dice_fast.pieces.tokenize_bounded` of ``texts`` (after ``kind``'s prefix, as `tokenize`):
        tokenizer calls of about ``piece_chars`` characters, each holding the tokenizer alone, so another
        thread waits at most one piece; ``check`` / ``enough`` stop early (see there). Thread-safe."""
        return tokenize_bounded(self.engine_tokenizer, texts, self._tokenizer_lock, piece_chars=piece_chars, check=check,
                                enough=enough, what=what, after=self.settings.text_prefix(kind))

    def cuts_are_exact(self) -> bool:
        """Whether cutting a text at a space between words gives the ids of the whole with this
        tokenizer (`dice_fast.pieces.cuts_are_exact`), so `tokenize_bounded` may cut long texts. Probed once."""
        if self._cuts_exact is None:
            with self._tokenizer_lock:
                self._cuts_exact = cuts_are_exact(self.engine_tokenizer)
        return self._cuts_exact

    # ----------------------------------------------------------------------------------------
    def _plan(self, texts: list[str], kind: str, base: int = 0, spans: bool = True,
              strategy: str | None = None) -> EncodingPlan:
        """`plan`; ``spans=False`` skips the tokens' character spans (nothing the caller returns uses them)."""
        chunking = self.settings.chunking(kind, strategy)  # a strategy the options cannot take fails first
        return self._plan_tokens(self.tokenize(texts, what=kind, base=base, spans=spans, kind=kind), kind, base, chunking)

    def _plan_tokens(self, tokens: TokenizedDocuments, kind: str, base: int = 0, chunking=None,
                     strategy: str | None = None) -> EncodingPlan:
        wrap, size, overlap, cap, global_positions, late, unpooled = chunking or self.settings.chunking(kind, strategy)
        check_vocabulary(tokens, self.spec.vocab_size, kind, base)
        chunks = plan_chunks(tokens.lengths, size, overlap, cap)
        windows = None if late is None else plan_windows(chunks, tokens.lengths, *late)
        plan = EncodingPlan(tokens, chunks, wrap[0], wrap[1], global_positions, windows, unpooled)
        if kind == "queries":
            warn_truncated(tokens.lengths, size, self.window, kind)
        if global_positions:
            self._check_global_positions(plan, base)
        return plan

    def _run(self, plans: Iterator, aggregation: str, return_chunks: bool, progress, what: str = "documents",
             plan=None) -> Iterator:
        """Encode ``plans`` (`EncodingPlan`, or items ``plan(item)`` makes one of) through one `ChunkQueue`,
        keeping the next plan queued (and the one after planned and keyed in a worker thread) so batches
        run across plan boundaries; yield each plan's result in order. A batch that runs out of memory is
        split and retried (`ChunkQueue.run`); a chunk that fails alone raises `InputOutOfMemory` naming its
        text as ``what[i]`` in the call. The producer pipeline prepares the next batch meanwhile."""
        queue = self.chunk_queue(memory=MemoryCache(_CALL_MEMORY_BYTES), stats=self.chunk_stats)
        jobs: deque = deque()
        submitted = [0]  # texts in the plans submitted so far: a job's tag is its first text's index

        def prepare(item):
            p = item if plan is None else plan(item)
            return p, queue.keys_for(p)

        with Prefetch(plans, prepare) as ahead, contextlib.ExitStack() as stack:
            source = stack.enter_context(BatchPipeline(queue, self.device)) if self.settings.pipeline else queue
            later: list[Exception] = []  # the input's (or its planning's) error, raised after the windows before it

            def top_up():
                while len(jobs) < 2 and not later:
                    try:
                        item = ahead.next()
                    except Exception as exc:  # noqa: BLE001 - raised once the queued windows are out
                        later.append(exc)
                        return
                    if item is None:
                        return
                    jobs.append(queue.submit(item[0], aggregation, keep_chunks=return_chunks, tag=submitted[0],
                                             keys=item[1]))
                    submitted[0] += item[0].n_docs

            top_up()
            while jobs:
                batch = None if jobs[0].done else source.next_batch()
                if batch is None and not jobs[0].done:  # pragma: no cover - a queue bug, never silent
                    raise RuntimeError("dice_fast: a queued plan has no chunks left to run but is not done")
                if batch is not None:
                    failed = source.run(batch, self.run_batch)[1]
                    if failed:  # nothing of the call is returned: raise naming the text
                        err = failed[0].error
                        raise err.renamed(f"{what}[{failed[0].tag + err.index}]", failed[0].tag) from None
                    if progress is not None:
                        progress(sum(queue.documents_pooled(j) for j in batch.jobs), batch.packed.n_tokens)
                while jobs and jobs[0].done:
                    job = jobs.popleft()
                    if self.device.type == "cpu":
                        release_freed_memory(int(job.cum[-1]) if len(job.cum) else 0)  # the tokens it ran
                    if progress is not None and job.plan.n_chunks == 0:
                        progress(0, 0)
                    elif progress is not None and (known := queue.documents_pooled(job)):
                        progress(known, 0)  # documents whose every chunk was known already
                    if (bad := non_finite_document(job.plan, job.documents, job.chunks)) is not None:
                        raise NonFiniteOutput(job.tag + bad, self.precision, f"{what}[{job.tag + bad}]")
                    yield DiceOutput.of_plan(job.plan, job.documents, job.chunks) if return_chunks else job.documents
                    top_up()
            if later:
                raise later[0]

    def _check_global_positions(self, plan: EncodingPlan, base: int = 0) -> None:
        last = plan.chunks.start + plan.chunk_lengths  # positions used, per chunk
        bad = np.flatnonzero(last > self.spec.position_limit)
        if len(bad):
            d = int(plan.chunks.document[bad[0]]) + base
            raise TextError(f"positions='global' needs {int(last[bad[0]])} positions for document {d}, but the model "
                            f"has {self.spec.position_limit}; use positions='local' or max_chunks_per_document", d)

