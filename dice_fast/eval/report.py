"""What an `EvalResult` reads as: paper-style markdown tables, the markdown report, CSV rows.

    print(format_report(res)); write_csv(res, "benchmarks/eval/results.csv")

Tables: rows = methods, columns ``≤4k`` and ``>4k`` (macro averages over the lengths at most / above
``split`` tokens, the paper's columns), then each length. EDI: medians over the kept samples
(evidence margin >= 0.01) and the share of kept samples where EDI(DICE) < EDI(single) (paper: 92.8 %
of 12,779 samples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..runinfo import append_csv
from .run import GROUP_ALL, EvalResult

__all__ = ["PAPER_EDI_SHARE", "CSV_FIELDS", "METRICS", "macro_average", "format_table", "format_storage",
           "edi_by_length", "format_report", "csv_rows", "write_csv", "strategy_of"]

PAPER_EDI_SHARE = 0.928  # paper §2.2: DICE has lower EDI than single in 92.8 % of 12,779 filtered samples
CSV_FIELDS = (
    "date", "task", "seed", "model", "device", "device_name", "dtype", "torch", "transformers", "dice_fast",
    "method", "chunk_size", "aggregation", "top_k", "temperature", "length", "metric", "value", "n",
    "docs_per_length", "queries_per_length", "scoring", "normalize_chunks", "alpha",
)
METRICS = (("hit@1", "Hit@1 (%)"), ("ndcg@10", "nDCG@10 (%)"),
           ("evidence@1", "evidence@1 (%): top document is the gold one and its best chunk's span holds the answer"))


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------
def side_names(split: int) -> tuple[str, str]:
    """The names of the two macro-average columns: ``("<=4k", ">4k")`` for ``split=4096``."""
    s = f"{split // 1024}k" if split % 1024 == 0 else str(split)
    return f"<={s}", f">{s}"


def length_label(g) -> str:
    """A context length as a column label: 256 -> "256", 8192 -> "8k"; a non-numeric group as itself."""
    if not isinstance(g, (int, np.integer)):
        return str(g)
    return f"{g // 1024}k" if g >= 1024 and g % 1024 == 0 else str(int(g))


def macro_average(per_length: dict, split: int = 4096) -> dict:
    """{length: value} -> {"<=4k": mean over lengths <= split, ">4k": mean over lengths > split,
    "avg": mean over all lengths}; a side with no length (or a non-numeric length) is left out."""
    lo_name, hi_name = side_names(split)
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


def format_table(rows: dict, lengths: Sequence, split: int = 4096, scale: float = 100.0, digits: int = 1,
                 title: str | None = None, averages: bool = True) -> str:
    """A markdown table: rows = methods (``{label: {length: value}}``), columns ``<=4k``, ``>4k`` (macro
    averages, see `macro_average`; left out when ``averages`` is False), then each length. Values are
    multiplied by ``scale``."""
    lo_name, hi_name = side_names(split)
    numeric = [g for g in lengths if isinstance(g, (int, np.integer))] if averages else []
    sides = [s for s, ok in ((lo_name, any(g <= split for g in numeric)), (hi_name, any(g > split for g in numeric))) if ok]
    cols = sides + [length_label(g) for g in lengths]
    head = ["method"] + [c.replace("<=", "≤") for c in cols]
    lines = [] if title is None else [f"**{title}**", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(cols)) + "|"]
    for label, per in rows.items():
        avg = macro_average({g: per[g] for g in lengths if g in per}, split)
        vals = [avg.get(s, math.nan) for s in sides] + [per.get(g, math.nan) for g in lengths]
        cells = ["–" if not np.isfinite(v) else f"{v * scale:.{digits}f}" for v in vals]
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines)


def format_storage(res: EvalResult) -> str:
    """Markdown: bytes per document an index keeps for each scoring (dice: the document vector;
    maxsim: every chunk vector; hybrid: both), float32 / float16, from the mean chunk count per
    document of each chunk size and length."""
    from .evidence import storage_bytes

    dim = res.extra["dim"]
    cols = [length_label(g) for g in res.groups]
    lines = [f"**Storage per document** (KiB, float32 / float16; {dim}-d vectors; chunks per document in brackets)", "",
             "| scoring | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    one = storage_bytes(1, dim)["dice"]
    lines.append("| dice (document vector) | " + " | ".join(
        f"{one['float32'] / 1024:.2f} / {one['float16'] / 1024:.2f}" for _ in cols) + " |")
    for k, per in res.extra["chunks_per_doc"].items():
        for name in ("maxsim", "hybrid"):
            cells = []
            for g in res.groups:
                b = storage_bytes(per[g], dim)[name]
                cells.append(f"{b['float32'] / 1024:,.1f} / {b['float16'] / 1024:,.1f}" + (f" [{per[g]:g}]" if name == "maxsim" else ""))
            lines.append(f"| {name} k={k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# evidence diagnostics
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
            sel = st.kept & (res.edi_group == (g if g != GROUP_ALL else -1))
            if sel.any():
                med[name][g] = float(np.median(v[sel]))
                share[name][g] = float(np.mean(v[sel] < st.edi["single"][sel]))
    share.pop("single", None)
    return med, share


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------
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
    for metric, title in METRICS:
        rows = {res.method_info[m]["label"]: res.metrics[m][metric] for m in res.methods if metric in res.metrics[m]}
        if rows:
            lines += [format_table(rows, res.groups, res.length_split, title=title), ""]
    if res.extra.get("chunks_per_doc"):
        lines += [format_storage(res), ""]
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
        if res.groups != [GROUP_ALL]:
            for k in res.edi:
                med, share = edi_by_length(res, k)
                kept = {g: int((res.edi[k].kept & (res.edi_group == g)).sum()) for g in res.groups}
                lab = {n: ("single" if n == "single" else res.method_info[n]["label"]) for n in med}
                lines += [format_table({lab[n]: share[n] for n in share}, res.groups, res.length_split,
                                       title=f"Share of samples with EDI(DICE) < EDI(single) by length (%), chunk "
                                             f"size {k} (kept samples per length: "
                                             + ", ".join(f"{length_label(g)}: {c}" for g, c in kept.items()) + ")",
                                       averages=False), "",
                          format_table({lab[n]: med[n] for n in med}, res.groups, res.length_split, scale=1.0, digits=2,
                                       title=f"Median EDI by length, chunk size {k}", averages=False), ""]
    tl = ", ".join(f"{name} {t['seconds']:.1f} s" + (f" ({t['tokens'] / max(t['seconds'], 1e-9):,.0f} tok/s)"
                                                       if t["tokens"] else "") for name, t in res.timings.items())
    lines.append(f"Encoding time: {tl}.")
    if res.check:
        worst = max(res.check, key=res.check.get)
        lines.append(f"Derived-from-chunks vs `encode_documents` (first documents): max abs diff "
                     f"{res.check[worst]:.1e} ({worst}).")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# CSV
# ------------------------------------------------------------------------------------------------
def csv_rows(res: EvalResult) -> list[dict]:
    """One dict (keys `CSV_FIELDS`) per method x length x metric, plus EDI / EC and encoding-time rows."""
    base = {f: res.info.get(f, "") for f in CSV_FIELDS if f in res.info}
    base["docs_per_length"] = res.extra["docs_per_length"]
    base["queries_per_length"] = res.extra["queries_per_length"]
    rows = []

    def add(method, length, metric, value, n=""):
        mi = res.method_info.get(method, {"chunk_size": None, "aggregation": None})
        nc, alpha = mi.get("normalize_chunks"), mi.get("alpha")
        if nc is None and mi.get("scoring") in ("dice", "hybrid"):
            nc = res.extra.get("default_normalize_chunks")
        if alpha is None and mi.get("scoring") == "hybrid":
            alpha = res.extra.get("default_alpha")
        rows.append({**base, "method": method, "chunk_size": "" if mi["chunk_size"] is None else mi["chunk_size"],
                     "aggregation": mi["aggregation"] or ("single" if method == "single" else ""),
                     "length": length, "metric": metric, "value": _fmt(value), "n": n,
                     "scoring": mi.get("scoring") or "", "normalize_chunks": "" if nc is None else str(bool(nc)),
                     "alpha": "" if alpha is None else f"{alpha:g}"})

    for m in res.methods:
        for metric in res.metrics[m]:
            per = res.metrics[m][metric]
            for g in res.groups:
                if g in per:
                    add(m, g, metric, per[g], res.n_queries.get(g, ""))
            if res.groups != [GROUP_ALL]:
                for side, v in macro_average(per, res.length_split).items():
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
        if res.groups != [GROUP_ALL]:
            for g in res.groups:
                sel = st.kept & (res.edi_group == g)
                for name, v in st.edi.items():
                    tag = f"@k{k}" if name == "single" else ""
                    add(name, g, f"edi_median{tag}", float(np.median(v[sel])) if sel.any() else math.nan, int(sel.sum()))
                    if name != "single":
                        add(name, g, "edi_share_lower_than_single",
                            float(np.mean(v[sel] < st.edi["single"][sel])) if sel.any() else math.nan, int(sel.sum()))
    for name, t in res.timings.items():  # "queries", "single", "k64", "late-k64"
        size = name.rsplit("k", 1)[1] if name.startswith(("k", "late-k")) else ""
        rows.append({**base, "method": name, "chunk_size": size,
                     "aggregation": "", "length": "all", "metric": "encode_seconds", "value": _fmt(t["seconds"]),
                     "n": t["tokens"]})
    return rows


def strategy_of(res: EvalResult, method: str) -> str:
    """The strategy of ``method``: "single", "dice" or "late" (results saved before method_info had
    it: from the key)."""
    mi = res.method_info.get(method, {})
    if mi.get("strategy"):
        return mi["strategy"]
    return "single" if method == "single" else "late" if method.startswith("late-") else "dice"


def _fmt(v) -> str:
    return "nan" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{float(v):.6g}"


def write_csv(res: EvalResult, path) -> int:
    """Append `csv_rows` to ``path`` (`dice_fast.runinfo.append_csv`: the header when the file is new).
    Returns the number of rows written."""
    return append_csv(csv_rows(res), path, fieldnames=CSV_FIELDS)
