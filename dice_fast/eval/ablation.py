"""Summaries across eval runs: the ``normalize_chunks`` ablation and the choice of the hybrid blend.

    python -m dice_fast.eval.ablation --test OUT/passkey-float32-test.pkl OUT/needle-float32-test.pkl \\
                                      --dev OUT/dev/passkey-float32-dev.pkl OUT/dev/needle-float32-dev.pkl

Inputs are `EvalResult` pickles (``dice-fast eval --save-result``): test runs made with
``--normalize-chunks-ablation`` and dev runs (another seed) with ``--hybrid-alphas``.

* `normalize_chunks_table`: for every chunk size and aggregation (and the hybrid), Hit@1 macro-averaged
  over lengths with chunk vectors L2-normalised before aggregating ("norm") and as pooled ("raw"),
  per task, the difference, and how many (task, length) cells each setting wins.
* `choose_alpha`: the hybrid weight with the best mean Hit@1 over every (task, chunk size, length) of
  the dev runs (ties: higher mean nDCG@10, then the alpha nearest 0.5), with its table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .report import macro_average, strategy_of
from .run import EvalResult

__all__ = ["normalize_chunks_table", "alpha_table", "choose_alpha", "scoring_table", "main"]


def _variants(res: EvalResult) -> dict:
    """{(strategy, chunk_size, aggregation or "hybrid"): {True: key, False: key}} of an ablation run's
    methods (strategy "dice" or "late"; hybrid: the default blend only)."""
    out: dict = {}
    for m in res.methods:
        mi = res.method_info[m]
        if mi.get("normalize_chunks") is None or mi.get("alpha") is not None:
            continue
        out.setdefault((strategy_of(res, m), mi["chunk_size"], mi["aggregation"]), {})[bool(mi["normalize_chunks"])] = m
    return {k: v for k, v in out.items() if len(v) == 2}


def normalize_chunks_table(results: Sequence[EvalResult], metric: str = "hit@1") -> tuple[str, dict]:
    """(markdown, totals) comparing normalize_chunks on/off over ``results`` (one ablation run per task).

    Rows: chunk size x aggregation (and hybrid), late chunking's after DICE's (chunks "64 late"); per
    task: ``metric`` (%) macro-averaged over the lengths with normalised ("norm") and raw chunks and
    raw − norm; last columns: (task, length)
    cells won by raw / by norm / tied. totals: {"raw": wins, "norm": wins, "tie": ties,
    "mean_diff": mean raw − norm over every row and task (points)}.
    """
    keys = sorted({v for r in results for v in _variants(r)}, key=lambda x: (x[0] == "late", x[1], x[2]))
    head = ["chunks", "aggregation"]
    for name in _names(results):
        head += [f"{name} norm", f"{name} raw", f"{name} Δ"]
    head += ["cells raw > norm", "raw < norm", "tie"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    totals = {"raw": 0, "norm": 0, "tie": 0}
    diffs = []
    for st, k, agg in keys:
        cells, wins = [f"{k} late" if st == "late" else str(k), agg], [0, 0, 0]
        for r in results:
            v = _variants(r).get((st, k, agg))
            if v is None:
                cells += ["–"] * 3
                continue
            norm, raw = r.metrics[v[True]][metric], r.metrics[v[False]][metric]
            a, b = macro_average(norm, r.length_split)["avg"], macro_average(raw, r.length_split)["avg"]
            diffs.append(100 * (b - a))
            cells += [f"{100 * a:.1f}", f"{100 * b:.1f}", f"{100 * (b - a):+.1f}"]
            for g in r.groups:
                d = raw.get(g, math.nan) - norm.get(g, math.nan)
                wins[0 if d > 1e-12 else 1 if d < -1e-12 else 2] += 1
        totals["raw"] += wins[0]
        totals["norm"] += wins[1]
        totals["tie"] += wins[2]
        lines.append("| " + " | ".join(cells + [str(w) for w in wins]) + " |")
    totals["mean_diff"] = float(np.mean(diffs)) if diffs else math.nan
    return "\n".join(lines), totals


def _names(results: Sequence[EvalResult]) -> list[str]:
    """A column name per result: its task, with its lengths ("needle 8k", "needle 256–4k") when
    several results share the task."""
    from .report import length_label

    tasks = [r.task for r in results]
    out = []
    for r in results:
        if tasks.count(r.task) == 1:
            out.append(r.task)
        else:
            lo, hi = length_label(min(r.groups)), length_label(max(r.groups))
            out.append(f"{r.task} {lo}" if lo == hi else f"{r.task} {lo}–{hi}")
    return out


def alpha_table(results: Sequence[EvalResult], normalize_chunks: bool | None = None,
                metric: str = "hit@1") -> tuple[str, dict]:
    """(markdown, {alpha: mean ``metric``}) of the hybrid blends of dev runs made with a grid of
    ``hybrid_alphas``: rows = alpha; columns = task x chunk size (``"passkey k=64"``; late chunking's
    ``"passkey late k=64"``), macro average over lengths, then the mean over all of them (DICE's and
    late chunking's columns alike). ``normalize_chunks``: which setting's hybrid rows, when the runs
    ablated it (None: the runs' own setting)."""
    per: dict = {}
    cols = []
    for r in results:
        for m in r.methods:
            mi = r.method_info[m]
            if mi.get("scoring") != "hybrid" or mi.get("alpha") is None:
                continue
            if normalize_chunks is not None and mi.get("normalize_chunks") not in (None, normalize_chunks):
                continue
            col = f"{r.task} {'late ' if strategy_of(r, m) == 'late' else ''}k={mi['chunk_size']}"
            if col not in cols:
                cols.append(col)
            per.setdefault(mi["alpha"], {})[col] = macro_average(r.metrics[m][metric], r.length_split)["avg"]
    if not per:
        raise ValueError("no hybrid rows with an alpha grid in these results (run with --hybrid-alphas)")
    means = {a: float(np.mean([v[c] for c in cols if c in v])) for a, v in per.items()}
    lines = ["| alpha | " + " | ".join(cols) + " | mean |", "|---:|" + "---:|" * (len(cols) + 1)]
    for a in sorted(per):
        lines.append(f"| {a:g} | " + " | ".join(f"{100 * per[a].get(c, math.nan):.1f}" for c in cols)
                     + f" | **{100 * means[a]:.1f}** |")
    return "\n".join(lines), means


def choose_alpha(results: Sequence[EvalResult], normalize_chunks: bool | None = None) -> tuple[float, str]:
    """(alpha, markdown): the hybrid weight with the best mean Hit@1 over the dev ``results``
    (ties: the better mean nDCG@10, then the alpha nearest 0.5), and the Hit@1 and nDCG@10 tables."""
    hit_md, hit = alpha_table(results, normalize_chunks, "hit@1")
    ndcg_md, ndcg = alpha_table(results, normalize_chunks, "ndcg@10")
    best = max(hit, key=lambda a: (round(hit[a], 9), round(ndcg.get(a, -1), 9), -abs(a - 0.5)))
    md = f"**Hit@1 (%) of the hybrid by alpha (dev)**\n\n{hit_md}\n\n**nDCG@10 (%) by alpha (dev)**\n\n{ndcg_md}\n"
    return best, md


def scoring_table(res: EvalResult, metrics: Sequence[str] = ("hit@1", "evidence@1"), alpha: float | None = None,
                  normalize_chunks: bool | None = None) -> str:
    """Markdown: ``metrics`` (%, "a / b" per cell) by length for single, every DICE aggregation, MaxSim
    and the hybrid of ``res``, at one ``normalize_chunks`` setting (None: the run's default) and one
    hybrid ``alpha`` (None: the run's default blend); columns ≤4k / >4k (macro averages) then each length."""
    from .report import length_label, side_names

    nc = res.extra.get("default_normalize_chunks") if normalize_chunks is None else normalize_chunks
    rows = {}
    for m in res.methods:
        mi = res.method_info[m]
        if mi.get("normalize_chunks") is not None and mi["normalize_chunks"] != nc:
            continue
        if mi.get("scoring") == "hybrid" and mi.get("alpha") != alpha:
            continue
        label = mi["label"].replace(" (norm chunks)", "").replace(" (raw chunks)", "")
        rows[label] = [res.metrics[m].get(x, {}) for x in metrics]
    lo, hi = side_names(res.length_split)
    sample = next(iter(rows.values()))[0]
    sides = [x for x in (lo, hi) if x in macro_average(sample, res.length_split)]
    head = ["method"] + [x.replace("<=", "≤") for x in sides] + [length_label(g) for g in res.groups]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for label, pers in rows.items():
        avgs = [macro_average(p, res.length_split) for p in pers]
        cells = [" / ".join(_pct(a.get(x)) for a in avgs) for x in sides]
        cells += [" / ".join(_pct(p.get(g)) for p in pers) for g in res.groups]
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines)


def _pct(v) -> str:
    return "–" if v is None or not np.isfinite(v) else f"{100 * v:.0f}"


def main(argv=None) -> int:
    import argparse
    import pickle

    p = argparse.ArgumentParser(prog="python -m dice_fast.eval.ablation", description=__doc__.split("\n\n")[0])
    p.add_argument("--test", nargs="+", required=True, help="EvalResult pickles of the reported runs (one per task)")
    p.add_argument("--dev", nargs="*", default=[], help="EvalResult pickles of the dev runs with an alpha grid")
    args = p.parse_args(argv)

    def load(paths):
        out = []
        for path in paths:
            with open(path, "rb") as fh:
                out.append(pickle.load(fh))
        return out

    test, dev = load(args.test), load(args.dev)
    for metric in ("hit@1", "evidence@1", "ndcg@10"):
        md, tot = normalize_chunks_table(test, metric)
        print(f"## normalize_chunks: {metric} (%), macro average over lengths\n\n{md}\n\n"
              f"cells won: raw {tot['raw']}, norm {tot['norm']}, tied {tot['tie']}; "
              f"mean raw − norm {tot['mean_diff']:+.2f} points\n")
    alpha = None
    if dev:
        nc = dev[0].extra.get("default_normalize_chunks")
        alpha, md = choose_alpha(dev, nc)
        print(f"## hybrid blend on the dev split (normalize_chunks={nc})\n\n{md}\nchosen alpha: {alpha:g}\n")
    for r in test:
        a = alpha if r.extra.get("hybrid_alphas", (None,)) != (None,) else None
        print(f"## {r.task} (lengths {', '.join(map(str, r.groups))}): Hit@1 / evidence@1 (%) by scoring, "
              f"normalize_chunks={r.extra.get('default_normalize_chunks')}, hybrid alpha "
              f"{'default' if a is None else f'{a:g}'}\n\n{scoring_table(r, alpha=a)}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
