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

from .report import format_table, macro_average
from .run import EvalResult

__all__ = ["normalize_chunks_table", "alpha_table", "choose_alpha", "scoring_table", "main"]


def _variants(res: EvalResult) -> dict:
    """{(chunk_size, aggregation or "hybrid"): {True: key, False: key}} of an ablation run's methods
    (hybrid: the default blend only)."""
    out: dict = {}
    for m in res.methods:
        mi = res.method_info[m]
        if mi.get("normalize_chunks") is None or mi.get("alpha") is not None:
            continue
        out.setdefault((mi["chunk_size"], mi["aggregation"]), {})[bool(mi["normalize_chunks"])] = m
    return {k: v for k, v in out.items() if len(v) == 2}


def normalize_chunks_table(results: Sequence[EvalResult], metric: str = "hit@1") -> tuple[str, dict]:
    """(markdown, totals) comparing normalize_chunks on/off over ``results`` (one ablation run per task).

    Rows: chunk size x aggregation (and hybrid); per task: ``metric`` (%) macro-averaged over the
    lengths with normalised ("norm") and raw chunks and raw − norm; last columns: (task, length)
    cells won by raw / by norm / tied. totals: {"raw": wins, "norm": wins, "tie": ties,
    "mean_diff": mean raw − norm over every row and task (points)}.
    """
    keys = sorted({v for r in results for v in _variants(r)}, key=lambda x: (x[0], x[1]))
    head = ["chunks", "aggregation"]
    for r in results:
        head += [f"{r.task} norm", f"{r.task} raw", f"{r.task} Δ"]
    head += ["cells raw > norm", "raw < norm", "tie"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    totals = {"raw": 0, "norm": 0, "tie": 0}
    diffs = []
    for k, agg in keys:
        cells, wins = [str(k), agg], [0, 0, 0]
        for r in results:
            v = _variants(r).get((k, agg))
            if v is None:
                cells += ["–"] * 3
                continue
            norm, raw = r.metrics[v[True]][metric], r.metrics[v[False]][metric]
            a, b = macro_average(norm, r.split)["avg"], macro_average(raw, r.split)["avg"]
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


def alpha_table(results: Sequence[EvalResult], normalize_chunks: bool | None = None,
                metric: str = "hit@1") -> tuple[str, dict]:
    """(markdown, {alpha: mean ``metric``}) of the hybrid blends of dev runs made with a grid of
    ``hybrid_alphas``: rows = alpha; columns = task x chunk size (macro average over lengths), then
    the mean over all of them. ``normalize_chunks``: which setting's hybrid rows, when the runs
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
            col = f"{r.task} k={mi['chunk_size']}"
            if col not in cols:
                cols.append(col)
            per.setdefault(mi["alpha"], {})[col] = macro_average(r.metrics[m][metric], r.split)["avg"]
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


def scoring_table(res: EvalResult, metric: str, rows_for=("dice", "maxsim", "hybrid")) -> str:
    """``metric`` (%) by length for every method of ``res`` whose scoring is in ``rows_for`` at the
    run's own normalize_chunks setting (for ablation runs: the default's rows), single first."""
    default_nc = res.extra.get("default_normalize_chunks")
    rows = {}
    for m in res.methods:
        mi = res.method_info[m]
        if metric not in res.metrics[m] or mi.get("alpha") is not None:
            continue
        if mi.get("scoring", "dice") not in ("single",) + tuple(rows_for):
            continue
        if mi.get("normalize_chunks") is not None and mi["normalize_chunks"] != default_nc:
            continue
        rows[mi["label"].replace(" (norm chunks)", "").replace(" (raw chunks)", "")] = res.metrics[m][metric]
    return format_table(rows, res.groups, res.split)


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
    if dev:
        nc = dev[0].extra.get("default_normalize_chunks")
        alpha, md = choose_alpha(dev, nc)
        print(f"## hybrid blend on the dev split (normalize_chunks={nc})\n\n{md}\nchosen alpha: {alpha:g}\n")
    for r in test:
        for metric in ("hit@1", "evidence@1"):
            print(f"## {r.task}: {metric} (%) by scoring\n\n{scoring_table(r, metric)}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
