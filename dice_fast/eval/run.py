"""The evaluation run: single vector vs DICE on one task, one model, each chunk size encoded once.

    res = run_eval(build_task("passkey", enc.tokenizer, (256, 1024)), enc, chunk_sizes=(64, 254))

Methods: ``single`` (``strategy="single"``: one window of each document's first tokens, the
single-vector baseline) and DICE with every requested aggregation at every requested chunk size.
Each chunk size is encoded **once** (raw pooled chunk vectors: `dice_fast.eval.chunkstore`; the
engine runs identical chunks once per call and, with ``cache_dir``, keeps them in its chunk cache); every
aggregation is then computed from those chunk vectors with `dice_fast.ops.aggregate_documents` and
exactly the arguments the engine passes (``normalize_chunks`` as the encoder resolves it, ``top_k``,
``temperature``, ``normalize``, and for ``weighted_mean`` the wrapped token count of each chunk:
its text tokens plus special and prefix tokens), so the vectors equal ``encode_documents`` with that
aggregation (tested). Queries are encoded once.

Retrieval follows LongEmbed: a query's candidates are the documents of its context length; Hit@1 and
nDCG@10 per length (`retrieval.evaluate`). A local BEIR folder is one group ("all").

Diagnostics (`diagnostics.evidence_stats`): for every chunk size, EC and EDI on each query's gold
document, with that encoding's chunk vectors; EDI of a method uses that method's document vector
(``single``'s first-window vector, or the DICE aggregation's).
"""

from __future__ import annotations

import datetime as _dt
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import OptionError
from ..runinfo import device_name, model_label, versions
from ..scoring import DEFAULT_ALPHA, cu_from_chunk_document

__all__ = ["DEFAULT_AGGREGATIONS", "GROUP_ALL", "EvalResult", "raw_twin", "aggregate_from_chunks", "build_task",
           "run_eval", "method_key"]

DEFAULT_AGGREGATIONS = ("mean", "max", "topk_norm", "weighted_mean", "softmax_norm")
GROUP_ALL = "all"  # the one group of a local task


# ------------------------------------------------------------------------------------------------
# deriving every aggregation from one encoding
# ------------------------------------------------------------------------------------------------
def raw_twin(encoder, *, cache=None, **changes):
    """A `DiceEncoder` over ``encoder``'s model and tokenizer with ``changes`` applied to its options.

    Shares the loaded model (nothing is copied or moved). ``cache``: the twin's persistent chunk
    cache (a folder or an open `dice_fast.reuse.ChunkCache`; None: none). Raises ValueError if
    the model facts it reads differ from ``encoder``'s (a model wrapped with an explicit ``model_path``).
    """
    from .. import DiceEncoder

    twin = DiceEncoder(encoder.model, encoder.engine_tokenizer, config=encoder.config.replace(**changes), cache=cache)
    if twin.spec != encoder.spec:
        raise ValueError("cannot derive a twin encoder: the model facts differ from the encoder's "
                         f"({twin.spec} vs {encoder.spec}); build the encoder with from_pretrained(path)")
    return twin


def aggregate_from_chunks(encoder, raw, aggregation: str) -> np.ndarray:
    """Document vectors (n_docs, dim) float32 as ``encoder`` with ``aggregation`` would return them.

    raw: a `dice_fast.eval.chunkstore.RawChunks` (`encode_raw_chunks`), or the `DiceOutput` of
    ``encode_documents(texts, return_chunks=True)``, by an encoder with the same options as
    ``encoder`` except ``normalize_chunks=False`` (so ``raw.chunks`` are the chunk
    vectors as pooled, whose norms ``topk_norm``/``softmax_norm`` rank by; see `raw_twin`). Uses the
    arguments the engine passes: ``encoder.normalize_chunks`` (resolved), ``top_k``, ``temperature``,
    ``normalize``, and chunk weights = wrapped chunk lengths (text + special + prefix tokens, as
    `EncodingPlan.chunk_weights`).
    """
    import torch

    from ..ops import aggregate_documents

    n_docs = len(raw.document_tokens) if hasattr(raw, "document_tokens") else raw.n_docs
    cu = cu_from_chunk_document(raw.chunk_document, n_docs)
    text = np.asarray(raw.chunk_end) - np.asarray(raw.chunk_start)
    # the tokens a chunk is pooled over: late chunking pools its text tokens only (a chunk without text its
    # window; weight 1 here: such a chunk is its document's only one, so its weight cancels)
    late = encoder.config.strategy == "late"
    weights = (np.maximum(text, 1) if late else text + encoder.chunk_overhead).astype(np.float32)
    c = encoder.config
    out = aggregate_documents(
        torch.from_numpy(np.ascontiguousarray(raw.chunks, np.float32)), torch.from_numpy(cu),
        torch.from_numpy(weights), aggregation, c.top_k, c.temperature, encoder.normalize_chunks, c.normalize,
        impl=encoder.pooling_impl,
    )
    return out.numpy()


# ------------------------------------------------------------------------------------------------
# the evaluation
# ------------------------------------------------------------------------------------------------
@dataclass
class EvalResult:
    """Everything one `run_eval` measured.

    groups: context lengths (ints), or ``["all"]`` for a local task. methods: method keys in table
    order (``"single"``, ``"k64-mean"`` ...); method_info: key -> {"label", "chunk_size", "aggregation",
    "scoring" ("dice" for an aggregation, "maxsim", "hybrid", "single"), "strategy" ("single", "dice" or
    "late"), "normalize_chunks", "alpha"}.
    metrics: key -> {"hit@1" | "ndcg@10": {group: value}}; n_queries: {group: count}.
    edi: chunk size -> `EvidenceStats` with methods ``"single"`` and ``"k{size}-{agg}"`` (late chunking:
    ``"{size} late"`` -> ``"single"`` and ``"late-k{size}-{agg}"``);
    edi_group: (n_edi_samples,) group of each EDI sample; timings: name -> {"seconds", "tokens"};
    check: method key -> max |derived - encode_documents| on the checked documents; info: run metadata.
    """

    task: str
    groups: list
    methods: list
    method_info: dict
    metrics: dict
    n_queries: dict
    edi: dict
    edi_group: np.ndarray
    timings: dict
    check: dict
    info: dict
    length_split: int = 4096
    window: int = 0
    aggregations: tuple = ()
    chunk_sizes: tuple = ()
    extra: dict = field(default_factory=dict)


def build_task(spec: str, tokenizer, lengths: Sequence[int] | None = None, docs_per_length: int = 100,
               queries_per_length: int = 50, seed: int = 0, split: str = "test"):
    """``spec``: "passkey", "needle", "boundary" (`dice_fast.eval.boundary`: ``docs_per_length`` documents,
    an even number, one query each; ``lengths`` and ``queries_per_length`` unused) or a local BEIR folder
    -> `dice_fast.eval.tasks.Task`."""
    from . import tasks

    if spec == "boundary":
        from .boundary import make_boundary_task

        if docs_per_length % 2:  # every person owns two pets: documents come in pairs
            raise OptionError(f"task boundary needs an even docs_per_length (--docs-per-length), got {docs_per_length}")
        return make_boundary_task(tokenizer, docs=docs_per_length, seed=seed)
    if spec in ("passkey", "needle"):
        make = tasks.make_passkey_task if spec == "passkey" else tasks.make_needle_task
        return make(tokenizer, lengths=tuple(lengths or tasks.CONTEXT_LENGTHS), docs_per_length=docs_per_length,
                    queries_per_length=queries_per_length, seed=seed)
    check_task(spec)
    return tasks.load_local_task(spec, split=split)


def check_task(spec: str) -> str:
    """``spec`` if `build_task` can build it (a synthetic task's name or a folder), else `OptionError`."""
    if spec in ("passkey", "needle", "boundary") or os.path.isdir(spec):
        return spec
    raise OptionError(f"--task must be passkey, needle, boundary or a BEIR folder (corpus.jsonl, queries.jsonl, "
                      f"qrels/), got {spec!r}")


def method_key(chunk_size: int, aggregation: str, normalize_chunks: bool | None = None,
               alpha: float | None = None, strategy: str = "dice") -> str:
    """The key of a method in `EvalResult.methods`: DICE ``aggregation`` at ``chunk_size`` ->
    ``"k64-mean"``; ``"maxsim"`` / ``"hybrid"`` likewise (``"k64-maxsim"``). With ``normalize_chunks``
    (the ablation of both settings) ``"-norm"`` / ``"-raw"`` is appended; with ``alpha`` (a grid of
    hybrid blends) ``"@0.25"``; late chunking's keys start ``"late-"``."""
    key = ("late-" if strategy == "late" else "") + f"k{chunk_size}-{aggregation}"
    if normalize_chunks is not None:
        key += "-norm" if normalize_chunks else "-raw"
    if alpha is not None:
        key += f"@{alpha:g}"
    return key


def _method_label(chunk_size: int, aggregation: str, normalize_chunks: bool | None = None,
                  alpha: float | None = None, strategy: str = "dice") -> str:
    name = {"maxsim": "MaxSim", "hybrid": "hybrid"}.get(aggregation, f"DICE {aggregation}")
    if strategy == "late":
        name = "late " + name.replace("DICE ", "")
    label = f"{name} k={chunk_size}"
    if alpha is not None:
        label += f" α={alpha:g}"
    if normalize_chunks is not None:
        label += " (norm chunks)" if normalize_chunks else " (raw chunks)"
    return label


def _run_info(encoder, task, seed) -> dict:
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "task": task.name,
        "seed": "" if seed is None else int(seed),
        "model": model_label(encoder.spec.name),
        "device": str(encoder.device),
        "device_name": device_name(encoder.device),
        "dtype": encoder.precision,
        **versions(),
        "top_k": encoder.config.top_k,
        "temperature": encoder.config.temperature,
    }


def run_eval(task, encoder, *, chunk_sizes: Sequence[int] = (64, 128, 254),
             aggregations: Sequence[str] = DEFAULT_AGGREGATIONS, length_split: int = 4096, seed: int | None = None,
             check_docs: int = 2, min_margin: float = 0.01, show_progress: bool = True,
             cache_dir=None, normalize_chunks: Sequence[bool] | None = None,
             scorings: Sequence[str] = ("maxsim", "hybrid"), hybrid_alphas: Sequence[float] | None = None,
             strategies: Sequence[str] = ("dice",), log=print) -> EvalResult:
    """Evaluate ``single`` and DICE (every aggregation x chunk size) of ``encoder``'s model on ``task``.

    task: a `dice_fast.eval.tasks.Task`; encoder: a `DiceEncoder` whose options (pooling, prefixes,
    top_k, temperature, normalize_chunks, normalize, overlap, positions ...) are used for every
    method, with ``chunk_size`` / ``aggregation`` / ``strategy`` set per method. ``length_split``: lengths
    at most / above it make the report's "≤4k" / ">4k" columns. ``check_docs``: the first documents
    of the task are also encoded by the engine with each method's options and compared with the
    vectors derived from chunks (`EvalResult.check`; a warning above 1e-4 in float32, 5e-2
    otherwise). ``cache_dir``: the persistent chunk cache (`dice_fast.reuse.persistent`) the raw chunk
    vectors are read from and written to, so a later run re-encodes no chunk it has seen; None: the
    encoder's own ``cache`` if it has one, else none (identical chunks within a call still run once).
    ``normalize_chunks``: None uses the encoder's (resolved) setting; a sequence such as
    ``(True, False)`` derives every aggregation (and the hybrid) under each setting from the same
    raw chunk vectors, keys ending in ``-norm`` / ``-raw``. ``scorings``: multi-vector rows per
    chunk size, "maxsim" and/or "hybrid" (`dice_fast.scoring`; the hybrid blends MaxSim with the
    document vector of the encoder's own aggregation). ``hybrid_alphas``: None for the scoring's
    default blend, or a grid (keys ``k64-hybrid@0.25``). ``strategies``: "dice" and/or "late" (late
    chunking: the same rows from late chunk vectors, keys ``late-k64-mean`` ..., EDI under ``"64 late"``).
    Synthetic tasks also get evidence@1
    (`dice_fast.eval.evidence`) for every chunked method. ``log``: called with progress lines
    (None: silent).
    """
    from .chunkstore import encode_timed, open_cache
    from .diagnostics import evidence_stats
    from .evidence import chunk_ranking, evidence_at_1, evidence_chunks
    from .retrieval import evaluate_ranking, search

    say = log or (lambda *_: None)
    aggregations = tuple(dict.fromkeys(aggregations))
    chunk_sizes = tuple(dict.fromkeys(int(k) for k in chunk_sizes))
    if not aggregations or not chunk_sizes:
        raise ValueError("need at least one aggregation and one chunk size")
    for a in aggregations:  # fail before any encoding: DiceConfig validates aggregation, top_k, temperature
        encoder.config.replace(aggregation=a)
    if encoder.config.truncate_dim is not None:  # the diagnostics compare full-width chunk and query vectors
        raise ValueError("the evaluation does not support truncate_dim (--truncate-dim); evaluate the full vectors")
    scorings = tuple(dict.fromkeys(scorings))
    if set(scorings) - {"maxsim", "hybrid"}:
        raise ValueError(f"scorings must be among 'maxsim', 'hybrid'; got {list(scorings)}")
    ablate = normalize_chunks is not None
    nc_settings = tuple(dict.fromkeys(bool(x) for x in normalize_chunks)) if ablate else (encoder.normalize_chunks,)
    if not nc_settings:
        raise ValueError("normalize_chunks: give at least one setting, or None for the encoder's")
    alphas = (None,) if hybrid_alphas is None else tuple(dict.fromkeys(float(x) for x in hybrid_alphas))
    if any(x is not None and not 0.0 <= x <= 1.0 for x in alphas) or not alphas:
        raise ValueError(f"hybrid_alphas must lie in [0, 1], got {hybrid_alphas}")
    if hybrid_alphas is not None and "hybrid" not in scorings:
        raise OptionError(f"hybrid_alphas (--hybrid-alphas) are blends of the hybrid scoring, but scorings "
                          f"(--scorings) is {list(scorings)}: add 'hybrid' to scorings or leave hybrid_alphas out")
    strategies = tuple(dict.fromkeys(strategies))
    if not strategies or set(strategies) - {"dice", "late"}:
        raise OptionError(f"strategies must be among 'dice', 'late'; got {list(strategies)}")
    if not task.queries:
        raise ValueError(f"task {task.name!r} has no queries")
    for st, k in ((st, k) for st in strategies for k in chunk_sizes):  # what a strategy refuses, before any encoding
        for a in dict.fromkeys(aggregations + (encoder.config.aggregation,)):
            raw_twin(encoder, chunk_size=k, strategy=st, aggregation=a)

    local = task.doc_tokens is None
    if local:
        groups = [GROUP_ALL]
        qg = dg = None
    else:
        groups = [int(g) for g in np.unique(task.doc_length)]
        qg, dg = task.query_length, task.doc_length
    info = _run_info(encoder, task, seed)
    timings: dict = {}

    # queries once, single once
    t0 = time.perf_counter()
    q = encoder.encode_queries(task.queries)
    timings["queries"] = {"seconds": time.perf_counter() - t0, "tokens": 0}
    single_enc = raw_twin(encoder, strategy="single")
    docs = {}
    store = open_cache(encoder, cache_dir)
    single_raw, timings["single"] = encode_timed(raw_twin(single_enc, normalize_chunks=False, cache=store), task,
                                                f"{task.name} single", show_progress)
    docs["single"] = aggregate_from_chunks(single_enc, single_raw, "mean")  # one chunk per document
    del single_raw
    method_info = {"single": _info(f"single (first {single_enc.window} tokens)", None, None, "single",
                                   strategy="single")}
    methods = ["single"]
    metrics, n_queries = {}, {}

    def score(key, idx, evidence=None):
        ev = evaluate_ranking(idx, task.qrels, query_groups=qg, split_at=length_split,
                              per_query=None if evidence is None else {"evidence@1": evidence})
        names = [m for m in ev["per_query"]]
        if local:
            metrics[key] = {m: {GROUP_ALL: ev[m]} for m in names}
            n_queries.update({GROUP_ALL: ev["n_queries"]})
        else:
            metrics[key] = {m: {g: ev["groups"][g][m] for g in groups if g in ev["groups"]} for m in names}
            n_queries.update({g: ev["groups"][g]["n_queries"] for g in groups if g in ev["groups"]})

    score("single", search(q, docs["single"], k=10, query_groups=qg, doc_groups=dg)[0])
    gold = task.gold_document()
    has_gold = gold >= 0
    edi, check, chunks_per_doc = {}, {}, {}
    n_check = min(check_docs, len(task.corpus))
    hybrid_agg = encoder.config.aggregation
    for st, k in ((st, k) for st in strategies for k in chunk_sizes):
        tag = f"late-k{k}" if st == "late" else f"k{k}"
        raw_enc = raw_twin(encoder, chunk_size=k, strategy=st, normalize_chunks=False, cache=store)
        raw, timings[tag] = encode_timed(raw_enc, task, f"{task.name} {st} k={k}", show_progress)
        t = timings[tag]
        say(f"[{task.name}] {st} chunk size {k}: {len(task.corpus)} documents, {raw.chunks.shape[0]} chunks "
            f"({raw.n_computed} computed, {raw.n_cached} from the cache), {t['tokens']:,} tokens run in {t['seconds']:.1f} s "
            f"({t['tokens'] / max(t['seconds'], 1e-9):,.0f} tokens/s)" + (" [cache]" if raw.from_cache else ""))
        counts = np.bincount(raw.chunk_document, minlength=len(task.corpus))
        chunks_per_doc.setdefault(k, {g: float(counts[np.asarray(task.doc_length) == g].mean()) for g in groups} \
            if not local else {GROUP_ALL: float(counts.mean())})
        with_evidence = task.answer_span is not None and raw.chunk_start_char is not None

        def evidence(idx):
            if not with_evidence:
                return None
            return evidence_at_1(idx[:, 0], evidence_chunks(q, raw, idx[:, 0]), raw, gold, task.answer_span)

        by_method = {"single": docs["single"]}
        doc_vecs = {}
        for nc in nc_settings:
            for a in dict.fromkeys(aggregations + ((hybrid_agg,) if "hybrid" in scorings else ())):
                enc_a = raw_twin(encoder, chunk_size=k, strategy=st, aggregation=a, normalize_chunks=nc)
                doc_vecs[a, nc] = vecs = aggregate_from_chunks(enc_a, raw, a)
                if a not in aggregations:
                    continue
                key = method_key(k, a, nc if ablate else None, strategy=st)
                docs[key] = by_method[key] = vecs
                methods.append(key)
                method_info[key] = _info(_method_label(k, a, nc if ablate else None, strategy=st), k, a, "dice", nc, st)
                score(key, (idx := search(q, vecs, k=10, query_groups=qg, doc_groups=dg)[0]), evidence(idx))
                if n_check:
                    ref = enc_a.encode_documents(task.corpus[:n_check])
                    check[key] = float(np.abs(ref - vecs[:n_check]).max())
        if "maxsim" in scorings:
            key = method_key(k, "maxsim", strategy=st)
            methods.append(key)
            method_info[key] = _info(_method_label(k, "maxsim", strategy=st), k, "maxsim", "maxsim", None, st)
            score(key, (idx := chunk_ranking(q, raw, qg, dg, k=10)[0]), evidence(idx))
        if "hybrid" in scorings:
            for nc in nc_settings:
                for alpha in alphas:
                    key = method_key(k, "hybrid", nc if ablate else None, alpha, strategy=st)
                    methods.append(key)
                    method_info[key] = {**_info(_method_label(k, "hybrid", nc if ablate else None, alpha, st), k,
                                                "hybrid", "hybrid", nc, st), "alpha": alpha, "base": hybrid_agg}
                    idx = chunk_ranking(q, raw, qg, dg, "hybrid", doc_vecs[hybrid_agg, nc], alpha, k=10)[0]
                    score(key, idx, evidence(idx))
        if has_gold.any():
            edi[f"{k} late" if st == "late" else k] = evidence_stats(q[has_gold], raw.chunks, raw.chunk_document, gold[has_gold], by_method,
                                    min_margin=min_margin)
        del raw
    if cache_dir is not None and store is not None:
        store.close()  # opened here (the encoder's own cache stays open)
    if check:
        tol = 1e-4 if info["dtype"] == "float32" else 5e-2
        worst = max(check, key=check.get)
        say(f"[{task.name}] aggregation-from-chunks vs encode_documents on {n_check} documents: "
            f"max abs diff {check[worst]:.2e} ({worst})")
        if check[worst] > tol:
            warnings.warn(f"derived document vectors differ from encode_documents by {check[worst]:.2e} "
                          f"({worst}), above {tol}", stacklevel=2)

    edi_group = (np.full(int(has_gold.sum()), -1, np.int64) if local else np.asarray(task.query_length)[has_gold])
    return EvalResult(
        task=task.name, groups=groups, methods=methods, method_info=method_info, metrics=metrics,
        n_queries=n_queries, edi=edi, edi_group=edi_group, timings=timings, check=check, info=info, length_split=length_split,
        window=single_enc.window, aggregations=aggregations, chunk_sizes=chunk_sizes,
        extra={"n_docs": len(task.corpus), "n_queries": len(task.queries),
               "docs_per_length": _per_group(task.doc_length) if not local else len(task.corpus),
               "queries_per_length": _per_group(task.query_length) if not local else len(task.queries),
               "chunks_per_doc": chunks_per_doc, "dim": int(q.shape[1]), "scorings": scorings,
               "normalize_chunks": nc_settings if ablate else None, "hybrid_alphas": alphas,
               "default_normalize_chunks": bool(encoder.normalize_chunks), "hybrid_aggregation": hybrid_agg,
               "default_alpha": float(DEFAULT_ALPHA) if "hybrid" in scorings else None},
    )


def _info(label, chunk_size, aggregation, scoring, normalize_chunks=None, strategy="dice") -> dict:
    return {"label": label, "chunk_size": chunk_size, "aggregation": aggregation, "scoring": scoring,
            "normalize_chunks": normalize_chunks, "alpha": None, "strategy": strategy}


def _per_group(labels) -> int | str:
    counts = np.unique(np.asarray(labels), return_counts=True)[1]
    return int(counts[0]) if counts.size and (counts == counts[0]).all() else "varies"
