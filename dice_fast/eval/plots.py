"""Plots of an `EvalResult` (matplotlib, imported on first use; PNG through the Agg backend).

    plot_hit_vs_length(res, "hit.png"); plot_edi(res, "edi.png")
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import require

from .report import PAPER_EDI_SHARE, edi_by_length, length_label, side_names, strategy_of
from .run import GROUP_ALL, EvalResult

__all__ = ["plot_hit_vs_length", "plot_edi", "need_matplotlib"]

_AGG_SHORT = {"mean": "mean", "max": "max", "topk_norm": "topk", "weighted_mean": "wmean", "softmax_norm": "softmax",
              "maxsim": "MaxSim", "hybrid": "hybrid"}


def need_matplotlib() -> None:
    """`MissingDependency` naming the extra unless matplotlib is installed (``dice-fast eval`` asks before
    the model loads: it found out after the first task had run, and the later tasks never did)."""
    require("matplotlib", extra="eval", needed_by="plotting", hint=" (or pip install matplotlib), or pass --no-plots",
            load=False)


def _pyplot():
    need_matplotlib()
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


_COLORS = {"mean": "#1f77b4", "max": "#d62728", "topk_norm": "#2ca02c", "weighted_mean": "#9467bd",
           "maxsim": "#8c564b", "hybrid": "#e377c2",
           "softmax_norm": "#ff7f0e"}
# line style per aggregation, so that curves lying on top of each other stay visible
_STYLES = {"mean": dict(ls="-", lw=3.0, marker="o", ms=5), "max": dict(ls="-", lw=1.6, marker="^", ms=5),
           "topk_norm": dict(ls="-.", lw=1.4, marker="v", ms=4), "weighted_mean": dict(ls=":", lw=2.0, marker="D", ms=3),
           "softmax_norm": dict(ls=(0, (5, 1)), lw=1.2, marker="x", ms=5)}


def _panel(res: EvalResult, k: int, scorings=("dice", "maxsim", "hybrid"),
           strategies=("dice", "late")) -> list[tuple[str, str]]:
    """(method key, aggregation or scoring name) of the methods drawn in chunk size ``k``'s panel: those
    of ``scorings`` and ``strategies`` at the run's own normalize_chunks setting and hybrid blend (an
    ablation's other setting and an alpha grid are in the tables, not the plots)."""
    default_nc = res.extra.get("default_normalize_chunks")
    out = []
    for m in res.methods:
        mi = res.method_info[m]
        if mi["chunk_size"] != k or mi.get("scoring", "dice") not in scorings or mi.get("alpha") is not None:
            continue
        if strategy_of(res, m) not in strategies:
            continue
        if mi.get("normalize_chunks") is not None and mi["normalize_chunks"] != default_nc:
            continue
        out.append((m, mi["aggregation"]))
    return out


def _style(a: str, strategy: str = "dice") -> dict:
    style = {"color": _COLORS.get(a, "grey"), **_STYLES.get(a, dict(ls="-", lw=1.4, marker="o", ms=4))}
    if strategy == "late":  # same colour as DICE's line of the aggregation, dashed, hollow markers
        style.update(ls="--", lw=min(style["lw"], 1.6), mfc="none", alpha=0.8)
    return style


def _line_label(a: str, strategy: str) -> str:
    """"DICE mean", "MaxSim", "late mean", "late MaxSim" ..."""
    name = _AGG_SHORT.get(a, a) if a not in _STYLES else a
    if strategy == "late":
        return f"late {name}"
    return f"DICE {name}" if a in _STYLES else name


def _edi_columns(res: EvalResult) -> list[tuple[object, int, str]]:
    """(key of ``res.edi``, chunk size, strategy) of every EDI column: DICE's chunk sizes in order, then
    late chunking's (keys ``"64 late"``)."""
    out = [(k, k, "dice") for k in res.chunk_sizes if k in res.edi]
    return out + [(f"{k} late", k, "late") for k in res.chunk_sizes if f"{k} late" in res.edi]


def _length_axis(ax, res: EvalResult) -> None:
    xs = res.groups
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(xs) / 1.25, max(xs) * 1.25)
    ax.set_xticks(xs, [length_label(g) for g in xs], fontsize=8)
    ax.minorticks_off()
    if min(xs) <= res.window <= max(xs):
        ax.axvline(res.window, color="grey", ls=":", lw=1)
    if min(xs) <= res.length_split < max(xs):
        ax.axvspan(res.length_split * 1.41, max(xs) * 1.25, color="grey", alpha=0.07, lw=0)
    ax.set_xlabel("context length (tokens)")
    ax.grid(alpha=0.3)


def plot_hit_vs_length(res: EvalResult, path, metric: str = "hit@1") -> None:
    """One panel per chunk size: ``metric`` (%) vs context length (log2 x-axis), one line per aggregation,
    the single-vector baseline dashed black, the model window dotted, lengths > split shaded.
    A local task (one group) gets horizontal bars instead."""
    plt = _pyplot()
    ks = list(res.chunk_sizes)
    if res.groups == [GROUP_ALL]:
        fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(res.methods) + 1.2), dpi=100)
        labels = [res.method_info[m]["label"] for m in res.methods]
        vals = [100 * res.metrics[m][metric][GROUP_ALL] for m in res.methods]
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
        late = any(strategy_of(res, m) == "late" for m in res.methods)
        for ax, k in zip(axes[0], ks):
            single = [100 * res.metrics["single"][metric].get(g, math.nan) for g in xs]
            ax.plot(xs, single, color="black", ls="--", marker="s", ms=4, lw=2.2,
                    label=f"single vector (first {res.window} tokens)", zorder=5)
            for key, a in _panel(res, k):
                if metric not in res.metrics[key]:
                    continue
                ys = [100 * res.metrics[key][metric].get(g, math.nan) for g in xs]
                st = strategy_of(res, key)
                ax.plot(xs, ys, label=_line_label(a, st), **_style(a, st))
            if metric == "hit@1" and isinstance(res.extra["docs_per_length"], int):
                chance = 100 / res.extra["docs_per_length"]
                ax.axhline(chance, color="grey", lw=0.8, ls="-", alpha=0.6)
                ax.text(xs[-1] * 1.2, chance + 1, "chance", fontsize=7, color="grey", ha="right", va="bottom")
            _length_axis(ax, res)
            ax.set_ylim(-4, 104)
            ax.set_title(f"{'' if late else 'DICE '}chunk size {k}", fontsize=10)
        axes[0][0].set_ylabel(f"{metric} (%)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
        sides = "; shaded: > " + side_names(res.length_split)[1][1:] if max(xs) > res.length_split else ""
        fig.suptitle(f"{res.task}: {metric} vs context length — {res.info['model']}, {res.info['dtype']}, "
                     f"{res.extra['docs_per_length']} candidates / length\n(dotted: model window "
                     f"{res.window}{sides})", fontsize=9)
        fig.tight_layout(rect=(0, 0.04 + 0.045 * math.ceil(len(labels) / 3), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_edi(res: EvalResult, path) -> None:
    """One column per chunk size (and per chunk size of late chunking). Top: box plots (5–95 % whiskers)
    of EDI over the kept samples, single vs each aggregation, with the share of samples where its EDI is
    below single's above each box. Bottom (synthetic tasks): that share per context length, against the
    paper's 92.8 %."""
    plt = _pyplot()
    cols = _edi_columns(res)
    if not cols:
        return
    by_length = res.groups != [GROUP_ALL]
    rows = 2 if by_length else 1
    fig, axes = plt.subplots(rows, len(cols), figsize=(4.2 * len(cols) + 0.6, 3.4 * rows + 0.7), dpi=100,
                             squeeze=False)
    for col, (ek, k, strategy) in enumerate(cols):
        ax = axes[0][col]
        st = res.edi[ek]
        kept = st.kept
        panel = [(m, a) for m, a in _panel(res, k, ("dice",), (strategy,)) if m in st.edi]
        who = "late" if strategy == "late" else "DICE"
        names = ["single"] + [m for m, _ in panel]
        data = [st.edi[n][kept] for n in names]
        labels = ["single"] + [_AGG_SHORT.get(a, a) for _, a in panel]
        colors = ["lightgrey"] + [_COLORS.get(a, "grey") for _, a in panel]
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
        ax.set_title(f"{who} chunk size {k}: EDI of {int(kept.sum())} kept / {kept.size} samples\n"
                     f"(% = share with EDI({who}) < EDI(single))", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        if by_length:
            ax2 = axes[1][col]
            _, share = edi_by_length(res, ek)
            for m, a in panel:
                per = share.get(m, {})
                ax2.plot(res.groups, [100 * per.get(g, math.nan) for g in res.groups], label=_line_label(a, strategy),
                         **_style(a, strategy))
            ax2.axhline(100 * PAPER_EDI_SHARE, color="black", ls="--", lw=1.2, label="paper: 92.8% (all samples)")
            ax2.axhline(50, color="grey", ls=":", lw=0.8)
            _length_axis(ax2, res)
            ax2.set_ylim(-4, 104)
            ax2.set_title(f"{who} chunk size {k}: share with EDI({who}) < EDI(single), by length", fontsize=8)
    axes[0][0].set_ylabel("EDI (lower is better)")
    if by_length:
        axes[1][0].set_ylabel("share of samples (%)")
        seen = {}
        for ax2 in axes[1]:  # DICE's and late chunking's lines, each label once
            for h, lab in zip(*ax2.get_legend_handles_labels()):
                seen.setdefault(lab, h)
        fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=3, fontsize=8, frameon=False)
    who = "DICE and late chunking" if any(c[2] == "late" for c in cols) else "DICE"
    fig.suptitle(f"{res.task}: Evidence Dilution Index, single vs {who} — {res.info['model']}, {res.info['dtype']}; "
                 f"paper: DICE below single in {PAPER_EDI_SHARE:.1%} of samples", fontsize=9)
    fig.tight_layout(rect=(0, 0.07 if by_length else 0, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
