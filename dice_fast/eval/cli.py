"""The ``dice-fast eval`` sub-command: its arguments, the run, and the files it writes.

    register_cli(parser.add_subparsers())     # what the root `dice-fast` command does

    dice-fast eval --task passkey needle --lengths 256,1024,8192 --docs-per-length 20 \\
        --queries-per-length 10 --chunk-sizes 64,254 --out-dir benchmarks/eval
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..cliargs import add_encoder_arguments, bounded, make_encoder
from ..errors import OptionError, writing
from ..side_files import replace_file

if TYPE_CHECKING:
    from .run import EvalResult

__all__ = ["register_cli", "cmd_eval", "check_options", "write_outputs"]


class _DefaultInt(int):
    """An int default of argparse, told apart from the same value given on the command line."""


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's, silent where the help states its own default or there is none to state (it printed
    "(default: the bundled all-MiniLM-L6-v2) (default: None)")."""

    def _get_help_string(self, action):
        if "(default" in (action.help or "") or action.default is None or action.default is False \
                or action.default == "":
            return action.help
        return super()._get_help_string(action)


class _DefaultList(list):
    """A list default of argparse, told apart from the same values given on the command line."""


# the tasks each task-shaping option applies to (a BEIR folder uses none of them)
_TASK_OPTIONS = (("--lengths", "lengths", ("passkey", "needle")),
                 ("--queries-per-length", "queries_per_length", ("passkey", "needle")),
                 ("--docs-per-length", "docs_per_length", ("passkey", "needle", "boundary")))


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _str_list(text: str) -> list[str]:
    return [v for v in text.replace(",", " ").split() if v]


def _float_list(text: str) -> list[float]:
    try:
        vals = [float(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not 0.0 <= v <= 1.0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {text!r}")
    return vals


def register_cli(subparsers) -> None:
    """Add the ``eval`` sub-command to ``subparsers`` (from ``parser.add_subparsers()``)."""
    from .run import DEFAULT_AGGREGATIONS
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
            "size; --strategy is ignored (single always runs, --strategies picks the chunked ones); --aggregation "
            "is a row only when in --aggregations, but it is the document vector the hybrid scoring blends with "
            "MaxSim (default: mean); --top-k, --temperature, "
            "--normalize-chunks, --pooling, --overlap, --positions, prefixes, --max-length, --device and --dtype "
            "apply to every method. Example: dice-fast eval --task passkey needle --lengths 256,1024,8192 "
            "--docs-per-length 20 --queries-per-length 10 --chunk-sizes 64,254 --out-dir benchmarks/eval"
        ),
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--task", nargs="+", default=["passkey"], metavar="TASK",
                   help="one or more of: passkey, needle, boundary (generated; boundary: answers across a chunk "
                        "boundary, --docs-per-length documents), or a BEIR folder (corpus.jsonl, "
                        "queries.jsonl, qrels/<split>.tsv)")
    p.add_argument("--lengths", type=_int_list, default=_DefaultList(CONTEXT_LENGTHS),
                   help="context lengths in tokens of the model's tokenizer, comma-separated (passkey and needle)")
    p.add_argument("--docs-per-length", type=int, default=_DefaultInt(100),
                   help="documents per length = candidates of each query (LongEmbed: 100); boundary: its documents "
                        "(an even number)")
    p.add_argument("--queries-per-length", type=int, default=_DefaultInt(50),
                   help="queries per length (LongEmbed: 50; passkey and needle)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tasks")
    p.add_argument("--split", default="test", help="qrels split of a BEIR folder (qrels/<split>.tsv)")
    p.add_argument("--chunk-sizes", type=_int_list, default=None,
                   help="DICE chunk sizes in tokens, comma-separated (default: 64, 128 and the model's default "
                        "chunk size, e.g. 254 for a 256-token window; or --chunk-size alone when given)")
    p.add_argument("--aggregations", type=_str_list, default=list(DEFAULT_AGGREGATIONS),
                   help="DICE aggregations, comma-separated (mean, max, topk_norm, weighted_mean, softmax_norm)")
    p.add_argument("--scorings", type=_str_list, default=["maxsim", "hybrid"],
                   help="multi-vector rows per chunk size from the same chunk vectors, comma-separated: maxsim, "
                        "hybrid (dice_fast.scoring); 'none' for the aggregations only")
    p.add_argument("--strategies", type=_str_list, default=["dice"],
                   help="chunked strategies to evaluate, comma-separated: dice, late (late chunking: the same rows "
                        "from chunk vectors pooled inside windows of --window-tokens; keys late-k64-mean ...)")
    p.add_argument("--hybrid-alphas", type=_float_list, default=None,
                   help="a grid of hybrid blends (alpha in [0, 1], comma-separated) instead of the default one "
                        "(needs hybrid in --scorings)")
    p.add_argument("--normalize-chunks-ablation", action="store_true",
                   help="derive every aggregation (and the hybrid) with normalize_chunks on and off from the same "
                        "raw chunk vectors (method keys end in -norm / -raw)")
    p.add_argument("--length-split", type=int, default=4096,
                   help="lengths <= this are averaged into the '<=4k' column, longer ones into '>4k'")
    p.add_argument("--out-dir", default="benchmarks/eval", help="folder for the CSV, PNGs and markdown tables")
    p.add_argument("--csv", default=None, help="CSV file to append rows to (default: OUT_DIR/results.csv)")
    p.add_argument("--tag", default="", help="extra text in the names of the PNG / markdown files")
    p.add_argument("--check-docs", type=bounded(int, 0), default=2,
                   help="documents re-encoded by the engine per method to confirm the derived vectors (0: off)")
    p.add_argument("--no-plots", action="store_true", help="write no PNGs")
    p.add_argument("--save-result", action="store_true",
                   help="also pickle the EvalResult (per-sample EC/EDI included) to OUT_DIR/<task>-<dtype>.pkl, "
                        "to redraw tables and plots later without re-encoding")
    p.add_argument("--cache", "--cache-dir", dest="cache_dir", metavar="DIR", default=None,
                   help="the persistent chunk cache (DIR/chunks.sqlite, as --cache of encode and serve): chunk vectors are "
                        "kept there and reused on later runs with the same model (a run over other lengths, "
                        "aggregations or normalize_chunks re-encodes no chunk it has seen)")
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
    """Run the ``eval`` sub-command parsed by `register_cli`'s parser; returns the exit status."""
    from .report import format_report
    from .run import build_task, run_eval

    if args.docs_per_length < 1 or args.queries_per_length < 1:
        raise ValueError("--docs-per-length and --queries-per-length must be >= 1")
    check_options(args)
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
        res = run_eval(task, enc, chunk_sizes=chunk_sizes, aggregations=args.aggregations, length_split=args.length_split,
                       seed=args.seed if task.doc_tokens is not None else None, check_docs=args.check_docs,
                       cache_dir=args.cache_dir, scorings=[x for x in args.scorings if x != "none"],
                       hybrid_alphas=args.hybrid_alphas, strategies=args.strategies,
                       normalize_chunks=(True, False) if args.normalize_chunks_ablation else None,
                       show_progress=not args.quiet, log=lambda s: print(s, flush=True))
        print(format_report(res), flush=True)
        stem = "-".join(x for x in (_safe(res.task), res.info["dtype"], _safe(args.tag)) if x)
        written = write_outputs(res, out_dir, stem, csv_path, plots=not args.no_plots, save_result=args.save_result)
        print(f"[{task.name}] wrote {', '.join(written)} (total {time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


def check_options(args) -> None:
    """Refuse (`OptionError`) or warn, naming the option, where an option given would be ignored or changed:
    --lengths / --queries-per-length / --docs-per-length given for tasks that do not use them (refused when
    no task does, a warning on stderr when some do), an odd --docs-per-length for boundary, --hybrid-alphas
    without hybrid in --scorings. Before the model loads."""
    synthetic = ("passkey", "needle", "boundary")
    for opt, dest, used_by in _TASK_OPTIONS:
        if isinstance(getattr(args, dest), (_DefaultInt, _DefaultList)):
            continue  # not given
        users = [t for t in args.task if t in used_by]
        others = [t if t in synthetic else "a BEIR folder" for t in args.task if t not in used_by]
        if not others:
            continue
        if not users:
            raise OptionError(f"{opt} does not apply to --task {' '.join(args.task)} (it shapes "
                              f"{' and '.join(used_by)} only); leave it out")
        print(f"dice-fast eval: warning: {opt} applies to {', '.join(users)} only, not to "
              f"{', '.join(dict.fromkeys(others))}", file=sys.stderr, flush=True)
    if "boundary" in args.task and args.docs_per_length % 2:
        raise OptionError(f"--task boundary needs an even --docs-per-length (every person owns two pets, so "
                          f"documents come in pairs), got {args.docs_per_length}")
    if args.hybrid_alphas is not None and "hybrid" not in args.scorings:
        raise OptionError(f"--hybrid-alphas are blends of the hybrid scoring, but --scorings is "
                          f"{','.join(args.scorings)}: add hybrid to --scorings or leave --hybrid-alphas out")
    if not args.no_plots:
        from .plots import need_matplotlib

        need_matplotlib()
    _check_lists_and_paths(args)


def _check_lists_and_paths(args) -> None:
    """The tasks, aggregations, scorings, strategies and output paths, named by their flag, before the
    model loads (they failed after it, or, for a folder given as --csv, after the whole run)."""
    from ..ops.names import AGGREGATIONS
    from ..runinfo import check_csv
    from .run import check_task

    for spec in args.task:
        check_task(spec)
    for flag, values, allowed in (("--aggregations", args.aggregations, AGGREGATIONS),
                                  ("--scorings", args.scorings, ("maxsim", "hybrid", "none")),
                                  ("--strategies", args.strategies, ("dice", "late"))):
        if bad := [v for v in values if v not in allowed]:
            raise OptionError(f"{flag}: unknown {', '.join(map(repr, bad))}; allowed: {', '.join(allowed)}")
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise OptionError(f"--out-dir {args.out_dir} is a file; give a folder")
    csv_path = Path(args.csv) if args.csv is not None else Path(args.out_dir) / "results.csv"
    if csv_path.is_dir():
        raise OptionError(f"--csv {csv_path} is a folder; give a CSV file")
    check_csv(csv_path)  # rows wider than its header, or a last row cut off: refused now, not after the run


def write_outputs(res: EvalResult, out_dir, stem: str, csv_path, plots: bool = True,
                  save_result: bool = False) -> list[str]:
    """Write ``OUT_DIR/STEM.md`` (the report), append to ``csv_path``, and draw ``STEM-hit1.png`` and
    ``STEM-edi.png``; ``save_result`` also pickles ``res`` to ``STEM.pkl``. Returns the paths written."""
    from .report import format_report, write_csv

    out_dir = Path(out_dir)
    with writing(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    n = write_csv(res, csv_path)  # the rows first: a report that cannot be written loses none of them
    with writing(out_dir / f"{stem}.md"):  # a full disk: named with the file, the previous report kept
        replace_file(out_dir / f"{stem}.md", format_report(res))
    written = [f"{csv_path} (+{n} rows)", str(out_dir / f"{stem}.md")]
    if save_result:
        import pickle

        with writing(out_dir / f"{stem}.pkl"):
            replace_file(out_dir / f"{stem}.pkl", pickle.dumps(res))
        written.append(str(out_dir / f"{stem}.pkl"))
    if plots:
        from .plots import plot_edi, plot_hit_vs_length

        for suffix, fn in (("hit1", plot_hit_vs_length), ("edi", plot_edi)):
            png = out_dir / f"{stem}-{suffix}.png"
            with writing(png):
                fn(res, png)
            if png.exists():
                written.append(str(png))
    return written


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(text))
