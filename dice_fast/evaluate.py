"""``dice-fast eval``: the paper's retrieval evaluation, single vector vs DICE, on one model.

    enc = DiceEncoder.from_pretrained()
    task = make_passkey_task(enc.tokenizer, lengths=(256, 1024, 8192), docs_per_length=20, queries_per_length=10)
    res = run_eval(task, enc, chunk_sizes=(64, 254))
    print(format_report(res)); write_csv(res, "results.csv"); plot_hit_vs_length(res, "hit.png"); plot_edi(res, "edi.png")

Methods: ``single`` (``strategy="single"``: one window of each document's first tokens, the
single-vector baseline) and DICE with every requested aggregation at every requested chunk size.
Each chunk size is encoded **once** with ``return_chunks=True`` (raw pooled chunk vectors); every
aggregation is then computed from those chunk vectors with `dice_fast.ops.aggregate_documents` and
exactly the arguments the engine passes (``normalize_chunks`` as the encoder resolves it, ``top_k``,
``temperature``, ``normalize``, and for ``weighted_mean`` the wrapped token count of each chunk:
its text tokens plus special and prefix tokens), so the vectors equal ``encode_documents`` with that
aggregation (tested). Queries are encoded once.

Retrieval follows LongEmbed: a query's candidates are the documents of its context length; Hit@1 and
nDCG@10 per length, macro-averaged over the lengths <= ``split`` and > ``split`` tokens (the paper's
"≤ 4k" / "> 4k" columns). A local BEIR folder is one group ("all").

Diagnostics (`dice_fast.diagnostics`): for every chunk size, EC and EDI on each query's gold
document, with that encoding's chunk vectors; EDI of a method uses that method's document vector
(``single``'s first-window vector, or the DICE aggregation's). Reported: medians over the kept
samples (evidence margin >= 0.01) and the share of kept samples where EDI(DICE) < EDI(single)
(paper: 92.8 % of 12,779 samples).
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .runinfo import device_name, model_label, versions

__all__ = [
    "DEFAULT_AGGREGATIONS",
    "PAPER_EDI_SHARE",
    "EvalResult",
    "raw_twin",
    "aggregate_from_chunks",
    "macro_average",
    "format_table",
    "build_task",
    "run_eval",
    "format_report",
    "write_csv",
    "write_outputs",
    "edi_by_length",
    "plot_hit_vs_length",
    "plot_edi",
    "register_cli",
]

DEFAULT_AGGREGATIONS = ("mean", "max", "topk_norm", "weighted_mean", "softmax_norm")
PAPER_EDI_SHARE = 0.928  # paper §2.2: DICE has lower EDI than single in 92.8 % of 12,779 filtered samples
CSV_FIELDS = (
    "date", "task", "seed", "model", "device", "device_name", "dtype", "torch", "transformers", "dice_fast",
    "method", "chunk_size", "aggregation", "top_k", "temperature", "length", "metric", "value", "n",
    "docs_per_length", "queries_per_length",
)
_AGG_SHORT = {"mean": "mean", "max": "max", "topk_norm": "topk", "weighted_mean": "wmean", "softmax_norm": "softmax"}
_GROUP_ALL = "all"


# ------------------------------------------------------------------------------------------------
# deriving every aggregation from one encoding
# ------------------------------------------------------------------------------------------------
def raw_twin(encoder, **changes):
    """A `DiceEncoder` over ``encoder``'s model and tokenizer with ``changes`` applied to its options.

    Shares the loaded model (nothing is copied or moved). Raises ValueError if the model facts it
    reads differ from ``encoder``'s (a model wrapped with an explicit ``model_path``).
    """
    from .engine import DiceEncoder

    twin = DiceEncoder(encoder.model, encoder.tokenizer, config=encoder.config.replace(**changes))
    if twin.spec != encoder.spec:
        raise ValueError("cannot derive a twin encoder: the model facts differ from the encoder's "
                         f"({twin.spec} vs {encoder.spec}); build the encoder with from_pretrained(path)")
    return twin


def aggregate_from_chunks(encoder, raw, aggregation: str) -> np.ndarray:
    """Document vectors (n_docs, dim) float32 as ``encoder`` with ``aggregation`` would return them.

    raw: the `DiceOutput` of ``encode_documents(texts, return_chunks=True)`` by an encoder with the
    same options as ``encoder`` except ``normalize_chunks=False`` (so ``raw.chunks`` are the chunk
    vectors as pooled, whose norms ``topk_norm``/``softmax_norm`` rank by; see `raw_twin`). Uses the
    arguments the engine passes: ``encoder.normalize_chunks`` (resolved), ``top_k``, ``temperature``,
    ``normalize``, and chunk weights = wrapped chunk lengths (text + special + prefix tokens).
    """
    import torch

    from .ops import aggregate_documents

    n_docs = int(raw.documents.shape[0])
    cd = np.asarray(raw.chunk_document, np.int64)
    cu = np.zeros(n_docs + 1, np.int64)
    np.cumsum(np.bincount(cd, minlength=n_docs), out=cu[1:])
    weights = (np.asarray(raw.chunk_end) - np.asarray(raw.chunk_start) + encoder.chunk_overhead).astype(np.float32)
    c = encoder.config
    out = aggregate_documents(
        torch.from_numpy(np.ascontiguousarray(raw.chunks, np.float32)), torch.from_numpy(cu),
        torch.from_numpy(weights), aggregation, c.top_k, c.temperature, encoder.normalize_chunks, c.normalize,
        impl=encoder.pooling_impl,
    )
    return out.numpy()


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------
def _side_names(split: int) -> tuple[str, str]:
    s = f"{split // 1024}k" if split % 1024 == 0 else str(split)
    return f"<={s}", f">{s}"


def macro_average(per_length: dict, split: int = 4096) -> dict:
    """{length: value} -> {"<=4k": mean over lengths <= split, ">4k": mean over lengths > split,
    "avg": mean over all lengths}; a side with no length (or a non-numeric length) is left out."""
    lo_name, hi_name = _side_names(split)
    nums = {g: float(v) for g, v in per_length.items() if isinstance(g, (int, np.integer))}
    out = {}
    lo = [v for g, v in nums.items() if g <= split]
    hi = [v for g, v in nums.items() if g > split]
    if lo:
        out[lo_name] = float(np.mean(lo))
    if hi:
        out[hi_name] = float(np.mean(hi))
    if per_length:
        out["avg"] = float(np.mean([float(v) for v in per_length.values()]))
    return out


def _length_label(g) -> str:
    if not isinstance(g, (int, np.integer)):
        return str(g)
    return f"{g // 1024}k" if g >= 1024 and g % 1024 == 0 else str(int(g))


def format_table(rows: dict, lengths: Sequence, split: int = 4096, scale: float = 100.0, digits: int = 1,
                 title: str | None = None, averages: bool = True) -> str:
    """A markdown table: rows = methods (``{label: {length: value}}``), columns ``<=4k``, ``>4k`` (macro
    averages, see `macro_average`; left out when ``averages`` is False), then each length. Values are
    multiplied by ``scale``."""
    lo_name, hi_name = _side_names(split)
    numeric = [g for g in lengths if isinstance(g, (int, np.integer))] if averages else []
    sides = [s for s, ok in ((lo_name, any(g <= split for g in numeric)), (hi_name, any(g > split for g in numeric))) if ok]
    cols = sides + [_length_label(g) for g in lengths]
    head = ["method"] + [c.replace("<=", "≤") for c in cols]
    lines = [] if title is None else [f"**{title}**", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(cols)) + "|"]
    for label, per in rows.items():
        avg = macro_average({g: per[g] for g in lengths if g in per}, split)
        vals = [avg.get(s, math.nan) for s in sides] + [per.get(g, math.nan) for g in lengths]
        cells = ["–" if not np.isfinite(v) else f"{v * scale:.{digits}f}" for v in vals]
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# the evaluation
# ------------------------------------------------------------------------------------------------
@dataclass
class EvalResult:
    """Everything one `run_eval` measured.

    groups: context lengths (ints), or ``["all"]`` for a local task. methods: method keys in table
    order (``"single"``, ``"k64-mean"`` ...); method_info: key -> {"label", "chunk_size", "aggregation"}.
    metrics: key -> {"hit@1" | "ndcg@10": {group: value}}; n_queries: {group: count}.
    edi: chunk size -> `EvidenceStats` with methods ``"single"`` and ``"k{size}-{agg}"``;
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
    split: int = 4096
    window: int = 0
    aggregations: tuple = ()
    chunk_sizes: tuple = ()
    extra: dict = field(default_factory=dict)


def build_task(spec: str, tokenizer, lengths: Sequence[int] | None = None, docs_per_length: int = 100,
               queries_per_length: int = 50, seed: int = 0, split: str = "test"):
    """``spec``: "passkey", "needle" or a local BEIR folder -> `dice_fast.tasks.Task`."""
    from . import tasks

    if spec in ("passkey", "needle"):
        make = tasks.make_passkey_task if spec == "passkey" else tasks.make_needle_task
        return make(tokenizer, lengths=tuple(lengths or tasks.CONTEXT_LENGTHS), docs_per_length=docs_per_length,
                    queries_per_length=queries_per_length, seed=seed)
    if os.path.isdir(spec):
        return tasks.load_local_task(spec, split=split)
    raise ValueError(f"--task must be passkey, needle or a BEIR folder (corpus.jsonl, queries.jsonl, qrels/), got {spec!r}")


def _method_key(chunk_size: int, aggregation: str) -> str:
    return f"k{chunk_size}-{aggregation}"


def _method_label(chunk_size: int, aggregation: str) -> str:
    return f"DICE {aggregation} k={chunk_size}"


def _run_info(encoder, task, seed) -> dict:
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "task": task.name,
        "seed": "" if seed is None else int(seed),
        "model": model_label(encoder.spec.name),
        "device": str(encoder.device),
        "device_name": device_name(encoder.device),
        "dtype": str(encoder.dtype).replace("torch.", ""),
        **versions(),
        "top_k": encoder.config.top_k,
        "temperature": encoder.config.temperature,
    }


def _encode_docs(encoder, texts, desc: str, show_progress: bool, **kw):
    from .engine import ProgressBar

    bar = ProgressBar(len(texts), desc=desc, show=show_progress and bool(texts))
    t0 = time.perf_counter()
    try:
        out = encoder.encode_documents(texts, progress=bar, **kw)
    finally:
        bar.close()
    return out, {"seconds": time.perf_counter() - t0, "tokens": bar.tokens}


def run_eval(task, encoder, *, chunk_sizes: Sequence[int] = (64, 128, 254),
             aggregations: Sequence[str] = DEFAULT_AGGREGATIONS, split: int = 4096, seed: int | None = None,
             check_docs: int = 2, min_margin: float = 0.01, show_progress: bool = True,
             log=print) -> EvalResult:
    """Evaluate ``single`` and DICE (every aggregation x chunk size) of ``encoder``'s model on ``task``.

    task: a `dice_fast.tasks.Task`; encoder: a `DiceEncoder` whose options (pooling, prefixes,
    top_k, temperature, normalize_chunks, normalize, overlap, positions ...) are used for every
    method, with ``chunk_size`` / ``aggregation`` / ``strategy`` set per method. ``check_docs``: the
    first documents of the task are also encoded by the engine with each method's options and
    compared with the vectors derived from chunks (`EvalResult.check`; a warning above 1e-4 in
    float32, 5e-2 otherwise). ``log``: called with progress lines (None: silent).
    """
    from .diagnostics import evidence_stats
    from .ops.spec import check_aggregation
    from .retrieval import evaluate

    say = log or (lambda *_: None)
    aggregations = tuple(dict.fromkeys(aggregations))
    chunk_sizes = tuple(dict.fromkeys(int(k) for k in chunk_sizes))
    if not aggregations or not chunk_sizes:
        raise ValueError("need at least one aggregation and one chunk size")
    for a in aggregations:
        check_aggregation(a, encoder.config.top_k, encoder.config.temperature)
    if not task.queries:
        raise ValueError(f"task {task.name!r} has no queries")

    local = task.doc_tokens is None
    if local:
        groups = [_GROUP_ALL]
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
    docs["single"], timings["single"] = _encode_docs(single_enc, task.corpus, f"{task.name} single", show_progress)
    method_info = {"single": {"label": f"single (first {single_enc.window} tokens)", "chunk_size": None,
                              "aggregation": None}}
    methods = ["single"]

    gold = task.gold_document()
    has_gold = gold >= 0
    edi, check = {}, {}
    n_check = min(check_docs, len(task.corpus))
    for k in chunk_sizes:
        raw_enc = raw_twin(encoder, chunk_size=k, strategy="dice", normalize_chunks=False)
        raw, timings[f"k{k}"] = _encode_docs(raw_enc, task.corpus, f"{task.name} k={k}", show_progress,
                                            return_chunks=True)
        t = timings[f"k{k}"]
        say(f"[{task.name}] chunk size {k}: {len(task.corpus)} documents, {raw.chunks.shape[0]} chunks, "
            f"{t['tokens']:,} tokens in {t['seconds']:.1f} s ({t['tokens'] / max(t['seconds'], 1e-9):,.0f} tokens/s)")
        by_method = {"single": docs["single"]}
        for a in aggregations:
            key = _method_key(k, a)
            enc_a = raw_twin(encoder, chunk_size=k, strategy="dice", aggregation=a)
            docs[key] = aggregate_from_chunks(enc_a, raw, a)
            by_method[key] = docs[key]
            methods.append(key)
            method_info[key] = {"label": _method_label(k, a), "chunk_size": k, "aggregation": a}
            if n_check:
                ref = enc_a.encode_documents(task.corpus[:n_check])
                check[key] = float(np.abs(ref - docs[key][:n_check]).max())
        if has_gold.any():
            edi[k] = evidence_stats(q[has_gold], raw.chunks, raw.chunk_document, gold[has_gold], by_method,
                                    min_margin=min_margin)
        del raw
    if check:
        tol = 1e-4 if info["dtype"] == "float32" else 5e-2
        worst = max(check, key=check.get)
        say(f"[{task.name}] aggregation-from-chunks vs encode_documents on {n_check} documents: "
            f"max abs diff {check[worst]:.2e} ({worst})")
        if check[worst] > tol:
            warnings.warn(f"derived document vectors differ from encode_documents by {check[worst]:.2e} "
                          f"({worst}), above {tol}", stacklevel=2)

    metrics, n_queries = {}, {}
    for key in methods:
        ev = evaluate(q, docs[key], task.qrels, query_groups=qg, doc_groups=dg, split_at=split)
        if local:
            metrics[key] = {m: {_GROUP_ALL: ev[m]} for m in ("hit@1", "ndcg@10")}
            n_queries = {_GROUP_ALL: ev["n_queries"]}
        else:
            metrics[key] = {m: {g: ev["groups"][g][m] for g in groups if g in ev["groups"]} for m in ("hit@1", "ndcg@10")}
            n_queries = {g: ev["groups"][g]["n_queries"] for g in groups if g in ev["groups"]}
    edi_group = (np.full(int(has_gold.sum()), -1, np.int64) if local else np.asarray(task.query_length)[has_gold])
    return EvalResult(
        task=task.name, groups=groups, methods=methods, method_info=method_info, metrics=metrics,
        n_queries=n_queries, edi=edi, edi_group=edi_group, timings=timings, check=check, info=info, split=split,
        window=single_enc.window, aggregations=aggregations, chunk_sizes=chunk_sizes,
        extra={"n_docs": len(task.corpus), "n_queries": len(task.queries),
               "docs_per_length": _per_group(task.doc_length) if not local else len(task.corpus),
               "queries_per_length": _per_group(task.query_length) if not local else len(task.queries)},
    )


def _per_group(labels) -> int | str:
    counts = np.unique(np.asarray(labels), return_counts=True)[1]
    return int(counts[0]) if counts.size and (counts == counts[0]).all() else "varies"


# ------------------------------------------------------------------------------------------------
# report, CSV
# ------------------------------------------------------------------------------------------------
def _edi_rows(res: EvalResult) -> list[dict]:
    """One dict per (chunk size, method): n kept, median EC, median EDI, share EDI < single."""
    rows = []
    for k, st in res.edi.items():
        s = st.summary()
        for name in st.edi:
            rows.append({
                "chunk_size": k, "method": name, "n_samples": s["n_samples"], "n_kept": s["n_kept"],
                "median_ec": s["median_ec"], "median_edi": s["median_edi"][name],
                "share_lower": math.nan if name == "single" else st.share_lower(name, "single"),
            })
    return rows


def edi_by_length(res: EvalResult, chunk_size: int) -> tuple[dict, dict]:
    """Per context length, over the kept samples of ``chunk_size``'s EDI: ({method: {length: median EDI}},
    {DICE method: {length: share of samples with EDI(method) < EDI(single)}}); lengths without kept samples
    are left out."""
    st = res.edi[chunk_size]
    med, share = {}, {}
    for name, v in st.edi.items():
        med[name], share[name] = {}, {}
        for g in res.groups:
            sel = st.kept & (res.edi_group == (g if g != _GROUP_ALL else -1))
            if sel.any():
                med[name][g] = float(np.median(v[sel]))
                share[name][g] = float(np.mean(v[sel] < st.edi["single"][sel]))
    share.pop("single", None)
    return med, share


def format_report(res: EvalResult) -> str:
    """Markdown: Hit@1 and nDCG@10 tables (rows: methods; columns: ≤4k, >4k, each length) and the EDI table."""
    i = res.info
    lines = [f"### {res.task} — {i['model']}, {i['device']} ({i['device_name']}), {i['dtype']}",
             "",
             f"{res.extra['n_docs']} documents, {res.extra['n_queries']} queries "
             f"({res.extra['docs_per_length']} documents / {res.extra['queries_per_length']} queries per length; "
             f"candidates = documents of the query's length), seed {i['seed']}, top_k {i['top_k']}, "
             f"temperature {i['temperature']}; model window {res.window} tokens; "
             f"torch {i['torch']}, transformers {i['transformers']}, dice_fast {i['dice_fast']}; {i['date']}",
             ""]
    for metric, title in (("hit@1", "Hit@1 (%)"), ("ndcg@10", "nDCG@10 (%)")):
        rows = {res.method_info[m]["label"]: res.metrics[m][metric] for m in res.methods}
        lines += [format_table(rows, res.groups, res.split, title=title), ""]
    if res.edi:
        lines += [f"**Evidence diagnostics** (gold documents; kept: margin m − ā ≥ 0.01; share = kept samples "
                  f"with EDI(DICE) < EDI(single); paper: {PAPER_EDI_SHARE:.1%})", "",
                  "| chunks | method | kept / samples | median EC | median EDI | share EDI < single |",
                  "|---:|---|---:|---:|---:|---:|"]
        for r in _edi_rows(res):
            label = res.method_info[r["method"]]["label"] if r["method"] != "single" else "single"
            share = "–" if not np.isfinite(r["share_lower"]) else f"{r['share_lower']:.1%}"
            lines.append(f"| {r['chunk_size']} | {label} | {r['n_kept']} / {r['n_samples']} | "
                         f"{r['median_ec']:.3f} | {r['median_edi']:.3f} | {share} |")
        lines.append("")
        if res.groups != [_GROUP_ALL]:
            for k in res.edi:
                med, share = edi_by_length(res, k)
                kept = {g: int((res.edi[k].kept & (res.edi_group == g)).sum()) for g in res.groups}
                lab = {n: ("single" if n == "single" else res.method_info[n]["label"]) for n in med}
                lines += [format_table({lab[n]: share[n] for n in share}, res.groups, res.split,
                                       title=f"Share of samples with EDI(DICE) < EDI(single) by length (%), chunk "
                                             f"size {k} (kept samples per length: "
                                             + ", ".join(f"{_length_label(g)}: {c}" for g, c in kept.items()) + ")",
                                       averages=False), "",
                          format_table({lab[n]: med[n] for n in med}, res.groups, res.split, scale=1.0, digits=2,
                                       title=f"Median EDI by length, chunk size {k}", averages=False), ""]
    tl = ", ".join(f"{name} {t['seconds']:.1f} s" + (f" ({t['tokens'] / max(t['seconds'], 1e-9):,.0f} tok/s)"
                                                       if t["tokens"] else "") for name, t in res.timings.items())
    lines.append(f"Encoding time: {tl}.")
    if res.check:
        worst = max(res.check, key=res.check.get)
        lines.append(f"Derived-from-chunks vs `encode_documents` (first documents): max abs diff "
                     f"{res.check[worst]:.1e} ({worst}).")
    return "\n".join(lines) + "\n"


def _csv_rows(res: EvalResult) -> list[dict]:
    base = {f: res.info.get(f, "") for f in CSV_FIELDS if f in res.info}
    base["docs_per_length"] = res.extra["docs_per_length"]
    base["queries_per_length"] = res.extra["queries_per_length"]
    rows = []

    def add(method, length, metric, value, n=""):
        mi = res.method_info.get(method, {"chunk_size": None, "aggregation": None})
        rows.append({**base, "method": method, "chunk_size": "" if mi["chunk_size"] is None else mi["chunk_size"],
                     "aggregation": mi["aggregation"] or ("single" if method == "single" else ""),
                     "length": length, "metric": metric, "value": _fmt(value), "n": n})

    for m in res.methods:
        for metric in ("hit@1", "ndcg@10"):
            per = res.metrics[m][metric]
            for g in res.groups:
                if g in per:
                    add(m, g, metric, per[g], res.n_queries.get(g, ""))
            if res.groups != [_GROUP_ALL]:
                for side, v in macro_average(per, res.split).items():
                    add(m, side, metric, v)
    for k, st in res.edi.items():
        for r in _edi_rows(res):
            if r["chunk_size"] != k:
                continue
            name = r["method"] if r["method"] != "single" else "single"
            tag = f"@k{k}" if name == "single" else ""
            add(name, "all", f"edi_median{tag}", r["median_edi"], r["n_kept"])
            add(name, "all", f"ec_median{tag}", r["median_ec"], r["n_kept"])
            if name != "single":
                add(name, "all", "edi_share_lower_than_single", r["share_lower"], r["n_kept"])
        if res.groups != [_GROUP_ALL]:
            for g in res.groups:
                sel = st.kept & (res.edi_group == g)
                for name, v in st.edi.items():
                    tag = f"@k{k}" if name == "single" else ""
                    add(name, g, f"edi_median{tag}", float(np.median(v[sel])) if sel.any() else math.nan, int(sel.sum()))
                    if name != "single":
                        add(name, g, "edi_share_lower_than_single",
                            float(np.mean(v[sel] < st.edi["single"][sel])) if sel.any() else math.nan, int(sel.sum()))
    for name, t in res.timings.items():
        method = "single" if name == "single" else ""
        rows.append({**base, "method": method or name, "chunk_size": name[1:] if name.startswith("k") else "",
                     "aggregation": "", "length": "all", "metric": "encode_seconds", "value": _fmt(t["seconds"]),
                     "n": t["tokens"]})
    return rows


def _fmt(v) -> str:
    return "nan" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{float(v):.6g}"


def write_csv(res: EvalResult, path) -> int:
    """Append one row per method x length x metric (plus EDI/EC and timing rows) to ``path``; writes the
    header when the file is new. Returns the number of rows written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = _csv_rows(res)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
    return len(rows)


# ------------------------------------------------------------------------------------------------
# plots
# ------------------------------------------------------------------------------------------------
def _pyplot():
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - optional dependency
        raise ImportError("plots need matplotlib: pip install 'dice-fast[eval]' (or pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


_COLORS = {"mean": "#1f77b4", "max": "#d62728", "topk_norm": "#2ca02c", "weighted_mean": "#9467bd",
           "softmax_norm": "#ff7f0e"}
# line style per aggregation, so that curves lying on top of each other stay visible
_STYLES = {"mean": dict(ls="-", lw=3.0, marker="o", ms=5), "max": dict(ls="-", lw=1.6, marker="^", ms=5),
           "topk_norm": dict(ls="-.", lw=1.4, marker="v", ms=4), "weighted_mean": dict(ls=":", lw=2.0, marker="D", ms=3),
           "softmax_norm": dict(ls=(0, (5, 1)), lw=1.2, marker="x", ms=5)}


def _style(a: str) -> dict:
    return {"color": _COLORS.get(a, "grey"), **_STYLES.get(a, dict(ls="-", lw=1.4, marker="o", ms=4))}


def _length_axis(ax, res: EvalResult) -> None:
    xs = res.groups
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(xs) / 1.25, max(xs) * 1.25)
    ax.set_xticks(xs, [_length_label(g) for g in xs], fontsize=8)
    ax.minorticks_off()
    if min(xs) <= res.window <= max(xs):
        ax.axvline(res.window, color="grey", ls=":", lw=1)
    if min(xs) <= res.split < max(xs):
        ax.axvspan(res.split * 1.41, max(xs) * 1.25, color="grey", alpha=0.07, lw=0)
    ax.set_xlabel("context length (tokens)")
    ax.grid(alpha=0.3)


def plot_hit_vs_length(res: EvalResult, path, metric: str = "hit@1") -> None:
    """One panel per chunk size: ``metric`` (%) vs context length (log2 x-axis), one line per aggregation,
    the single-vector baseline dashed black, the model window dotted, lengths > split shaded.
    A local task (one group) gets horizontal bars instead."""
    plt = _pyplot()
    ks = list(res.chunk_sizes)
    if res.groups == [_GROUP_ALL]:
        fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(res.methods) + 1.2), dpi=100)
        labels = [res.method_info[m]["label"] for m in res.methods]
        vals = [100 * res.metrics[m][metric][_GROUP_ALL] for m in res.methods]
        ax.barh(range(len(vals)), vals, color=["black"] + [_COLORS.get(res.method_info[m]["aggregation"], "grey")
                                                          for m in res.methods[1:]])
        ax.set_yticks(range(len(vals)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"{metric} (%)")
        ax.set_title(f"{res.task}: {metric} — {res.info['model']} ({res.info['dtype']})", fontsize=10)
        fig.tight_layout()
    else:
        fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks) + 0.6, 3.9), dpi=100, sharey=True, squeeze=False)
        xs = res.groups
        for ax, k in zip(axes[0], ks):
            single = [100 * res.metrics["single"][metric].get(g, math.nan) for g in xs]
            ax.plot(xs, single, color="black", ls="--", marker="s", ms=4, lw=2.2,
                    label=f"single vector (first {res.window} tokens)", zorder=5)
            for a in res.aggregations:
                key = _method_key(k, a)
                ys = [100 * res.metrics[key][metric].get(g, math.nan) for g in xs]
                ax.plot(xs, ys, label=f"DICE {a}", **_style(a))
            if metric == "hit@1" and isinstance(res.extra["docs_per_length"], int):
                chance = 100 / res.extra["docs_per_length"]
                ax.axhline(chance, color="grey", lw=0.8, ls="-", alpha=0.6)
                ax.text(xs[-1] * 1.2, chance + 1, "chance", fontsize=7, color="grey", ha="right", va="bottom")
            _length_axis(ax, res)
            ax.set_ylim(-4, 104)
            ax.set_title(f"DICE chunk size {k}", fontsize=10)
        axes[0][0].set_ylabel(f"{metric} (%)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
        sides = "; shaded: > " + _side_names(res.split)[1][1:] if max(xs) > res.split else ""
        fig.suptitle(f"{res.task}: {metric} vs context length — {res.info['model']}, {res.info['dtype']}, "
                     f"{res.extra['docs_per_length']} candidates / length\n(dotted: model window "
                     f"{res.window}{sides})", fontsize=9)
        fig.tight_layout(rect=(0, 0.04 + 0.045 * math.ceil(len(labels) / 3), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_edi(res: EvalResult, path) -> None:
    """One column per chunk size. Top: box plots (5–95 % whiskers) of EDI over the kept samples, single vs
    each DICE aggregation, with the share of samples where DICE's EDI is below single's above each box.
    Bottom (synthetic tasks): that share per context length, against the paper's 92.8 %."""
    plt = _pyplot()
    ks = [k for k in res.chunk_sizes if k in res.edi]
    if not ks:
        return
    by_length = res.groups != [_GROUP_ALL]
    rows = 2 if by_length else 1
    fig, axes = plt.subplots(rows, len(ks), figsize=(4.2 * len(ks) + 0.6, 3.4 * rows + 0.7), dpi=100, squeeze=False)
    for col, k in enumerate(ks):
        ax = axes[0][col]
        st = res.edi[k]
        kept = st.kept
        names = ["single"] + [_method_key(k, a) for a in res.aggregations]
        data = [st.edi[n][kept] for n in names]
        labels = ["single"] + [_AGG_SHORT.get(a, a) for a in res.aggregations]
        colors = ["lightgrey"] + [_COLORS.get(a, "grey") for a in res.aggregations]
        if kept.any():
            bp = ax.boxplot(data, whis=(5, 95), showfliers=False, patch_artist=True, widths=0.6,
                            medianprops={"color": "black"})
            for patch, c in zip(bp["boxes"], colors):
                patch.set_facecolor(c)
                patch.set_alpha(0.6)
            ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
            top = max(np.percentile(d, 95) for d in data)
            bottom = min(np.percentile(d, 5) for d in data)
            pad = 0.08 * (top - bottom or 1)
            ax.set_ylim(bottom - pad, top + 3 * pad)
            for j, n in enumerate(names[1:], start=2):
                ax.text(j, top + 1.5 * pad, f"{st.share_lower(n, 'single'):.0%}", ha="center", fontsize=8,
                        color=colors[j - 1], fontweight="bold")
        else:
            ax.text(0.5, 0.5, "no kept samples", ha="center", transform=ax.transAxes)
        ax.axhline(0, color="grey", lw=0.8, ls=":")
        ax.set_title(f"chunk size {k}: EDI of {int(kept.sum())} kept / {kept.size} samples\n"
                     f"(% = share with EDI(DICE) < EDI(single))", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        if by_length:
            ax2 = axes[1][col]
            _, share = edi_by_length(res, k)
            for a in res.aggregations:
                per = share.get(_method_key(k, a), {})
                ax2.plot(res.groups, [100 * per.get(g, math.nan) for g in res.groups], label=f"DICE {a}", **_style(a))
            ax2.axhline(100 * PAPER_EDI_SHARE, color="black", ls="--", lw=1.2, label="paper: 92.8% (all samples)")
            ax2.axhline(50, color="grey", ls=":", lw=0.8)
            _length_axis(ax2, res)
            ax2.set_ylim(-4, 104)
            ax2.set_title(f"chunk size {k}: share with EDI(DICE) < EDI(single), by length", fontsize=8)
    axes[0][0].set_ylabel("EDI (lower is better)")
    if by_length:
        axes[1][0].set_ylabel("share of samples (%)")
        handles, labels = axes[1][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"{res.task}: Evidence Dilution Index, single vs DICE — {res.info['model']}, {res.info['dtype']}; "
                 f"paper: DICE below single in {PAPER_EDI_SHARE:.1%} of samples", fontsize=9)
    fig.tight_layout(rect=(0, 0.07 if by_length else 0, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    import argparse

    try:
        vals = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _str_list(text: str) -> list[str]:
    return [v for v in text.replace(",", " ").split() if v]


def register_cli(subparsers, add_encoder_arguments) -> None:
    """Add the ``eval`` sub-command to ``subparsers`` (from ``parser.add_subparsers()``)."""
    import argparse

    from .tasks import CONTEXT_LENGTHS

    p = subparsers.add_parser(
        "eval",
        help="retrieval evaluation: single vector vs DICE (Hit@1 / nDCG@10 per context length, EC / EDI)",
        description=(
            "Evaluate the single-vector baseline and DICE (every --aggregations x --chunk-sizes) on LongEmbed-style "
            "passkey / needle tasks or a local BEIR folder. Each chunk size is encoded once and every aggregation "
            "is computed from its chunk vectors; queries are encoded once. A query's candidates are the documents "
            "of its context length. Prints paper-style tables (rows: methods; columns: <=4k and >4k macro "
            "averages, then each length), appends CSV rows (one per method x length x metric, with date, model, "
            "device, dtype and versions) and writes PNG plots (Hit@1 vs length; EDI of single vs DICE)."
        ),
        epilog=(
            "Of the shared model options, --chunk-size (when --chunk-sizes is not given) sets the only chunk "
            "size; --aggregation and --strategy are ignored (every method is run); --top-k, --temperature, "
            "--normalize-chunks, --pooling, --overlap, --positions, prefixes, --max-length, --device and --dtype "
            "apply to every method. Example: dice-fast eval --task passkey needle --lengths 256,1024,8192 "
            "--docs-per-length 20 --queries-per-length 10 --chunk-sizes 64,254 --out-dir benchmarks/eval"
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--task", nargs="+", default=["passkey"], metavar="TASK",
                   help="one or more of: passkey, needle (generated), or a BEIR folder (corpus.jsonl, "
                        "queries.jsonl, qrels/<split>.tsv)")
    p.add_argument("--lengths", type=_int_list, default=list(CONTEXT_LENGTHS),
                   help="context lengths in tokens of the model's tokenizer, comma-separated (synthetic tasks)")
    p.add_argument("--docs-per-length", type=int, default=100,
                   help="documents per length = candidates of each query (LongEmbed: 100)")
    p.add_argument("--queries-per-length", type=int, default=50, help="queries per length (LongEmbed: 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tasks")
    p.add_argument("--split", default="test", help="qrels split of a BEIR folder (qrels/<split>.tsv)")
    p.add_argument("--chunk-sizes", type=_int_list, default=None,
                   help="DICE chunk sizes in tokens, comma-separated (default: 64, 128 and the model's default "
                        "chunk size, e.g. 254 for a 256-token window; or --chunk-size alone when given)")
    p.add_argument("--aggregations", type=_str_list, default=list(DEFAULT_AGGREGATIONS),
                   help="DICE aggregations, comma-separated (mean, max, topk_norm, weighted_mean, softmax_norm)")
    p.add_argument("--length-split", type=int, default=4096,
                   help="lengths <= this are averaged into the '<=4k' column, longer ones into '>4k'")
    p.add_argument("--out-dir", default="benchmarks/eval", help="folder for the CSV, PNGs and markdown tables")
    p.add_argument("--csv", default=None, help="CSV file to append rows to (default: OUT_DIR/results.csv)")
    p.add_argument("--tag", default="", help="extra text in the names of the PNG / markdown files")
    p.add_argument("--check-docs", type=int, default=2,
                   help="documents re-encoded by the engine per method to confirm the derived vectors (0: off)")
    p.add_argument("--no-plots", action="store_true", help="write no PNGs")
    p.add_argument("--save-result", action="store_true",
                   help="also pickle the EvalResult (per-sample EC/EDI included) to OUT_DIR/<task>-<dtype>.pkl, "
                        "to redraw tables and plots later without re-encoding")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    add_encoder_arguments(p)
    p.set_defaults(func=cmd_eval)


def _default_chunk_sizes(encoder, args) -> list[int]:
    if args.chunk_sizes:
        return list(args.chunk_sizes)
    if args.chunk_size is not None:
        return [args.chunk_size]
    top = encoder.config.chunk_size
    return sorted({k for k in (64, 128) if k < top} | {top})


def cmd_eval(args) -> int:
    from .cli import make_encoder

    if args.docs_per_length < 1 or args.queries_per_length < 1:
        raise ValueError("--docs-per-length and --queries-per-length must be >= 1")
    enc = make_encoder(args)
    chunk_sizes = _default_chunk_sizes(enc, args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = Path(args.csv) if args.csv else out_dir / "results.csv"
    print(f"dice-fast eval: {enc}\nchunk sizes {chunk_sizes}, aggregations {args.aggregations}", flush=True)
    for spec in args.task:
        t0 = time.perf_counter()
        task = build_task(spec, enc.tokenizer, args.lengths, args.docs_per_length, args.queries_per_length,
                          args.seed, args.split)
        print(f"[{task.name}] {len(task.corpus)} documents, {len(task.queries)} queries "
              f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)
        res = run_eval(task, enc, chunk_sizes=chunk_sizes, aggregations=args.aggregations, split=args.length_split,
                       seed=args.seed if task.doc_tokens is not None else None, check_docs=args.check_docs,
                       show_progress=not args.quiet, log=lambda s: print(s, flush=True))
        print(format_report(res), flush=True)
        stem = "-".join(x for x in (_safe(res.task), res.info["dtype"], _safe(args.tag)) if x)
        written = write_outputs(res, out_dir, stem, csv_path, plots=not args.no_plots, save_result=args.save_result)
        print(f"[{task.name}] wrote {', '.join(written)} (total {time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


def write_outputs(res: EvalResult, out_dir, stem: str, csv_path, plots: bool = True,
                  save_result: bool = False) -> list[str]:
    """Write ``OUT_DIR/STEM.md`` (the report), append to ``csv_path``, and draw ``STEM-hit1.png`` and
    ``STEM-edi.png``; ``save_result`` also pickles ``res`` to ``STEM.pkl``. Returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(format_report(res), encoding="utf-8")
    n = write_csv(res, csv_path)
    written = [f"{csv_path} (+{n} rows)", str(out_dir / f"{stem}.md")]
    if save_result:
        import pickle

        with open(out_dir / f"{stem}.pkl", "wb") as fh:
            pickle.dump(res, fh)
        written.append(str(out_dir / f"{stem}.pkl"))
    if plots:
        for suffix, fn in (("hit1", plot_hit_vs_length), ("edi", plot_edi)):
            png = out_dir / f"{stem}-{suffix}.png"
            fn(res, png)
            if png.exists():
                written.append(str(png))
    return written


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(text))
