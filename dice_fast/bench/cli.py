"""``dice-fast bench``: its arguments and the command, registered by `dice_fast.cli`."""

from __future__ import annotations

import argparse

from ..cliargs import add_encoder_arguments, bounded, encoder_options, make_encoder
from .corpora import CORPORA, RANDOM_MODELS

DTYPES = ("float32", "bfloat16", "float16")


def register_cli(subparsers) -> None:
    """Add the ``bench`` subcommand to ``subparsers`` (an ``argparse`` subparsers action)."""
    p = subparsers.add_parser(
        "bench", help="throughput of the engine against naive chunk batching",
        description="Time the packed engine against naive chunk batching (padded_sorted: chunks sorted by "
        "length in padded batches, as the paper's code; padded_naive: chunks in corpus order in padded batches; "
        "sentence-transformers encode on chunk texts for sentence-transformers models) on the same model, "
        "options, dtype, device and corpus, interleaved; print a table and append rows to a CSV.",
    )
    g = p.add_argument_group("benchmark")
    g.add_argument("--random-model", choices=sorted(RANDOM_MODELS), default=None,
                   help="use a random-weight architecture instead of --model (speed only)")
    g.add_argument("--corpus", nargs="+", choices=CORPORA, default=["mixed"], help="corpora to run (default mixed)")
    g.add_argument("--docs", type=int, default=200, help="documents per corpus (default 200)")
    g.add_argument("--longest", type=bounded(int, 1), default=32768, help="longest document in tokens (default 32768)")
    g.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                   help="dtypes to compare (default: --dtype when given, else float32 and bfloat16)")
    g.add_argument("--padded-batch", type=int, default=32, help="chunks per padded batch of the naive paths (default 32)")
    g.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic corpora (default 0)")
    g.add_argument("--no-sentence-transformers", action="store_true", help="skip the sentence-transformers path")
    g.add_argument("--flops", action="store_true",
                   help="also report the engine's model TFLOP/s and MFU against the matmul rate of each dtype, "
                   "measured in the same run")
    g.add_argument("--budget-s", type=bounded(float, 0, above=True), default=None,
                   help="wall-clock seconds for the timed rounds of each corpus: a round starts only while the "
                   "slowest round so far still fits (at least one runs)")
    g.add_argument("--raw-csv", default=None,
                   help="also append every single timing (path, dtype, round, seconds) to this CSV as it is taken")
    g.add_argument("--csv", default="benchmarks/results.csv",
                   help="CSV to append rows to (default benchmarks/results.csv, from the working directory)")
    g.add_argument("--require-packed", action="store_true",
                   help="exit 1 when an engine runs chunks on the padded path instead of packed (rows are still written)")
    add_encoder_arguments(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    import torch

    from .. import DiceEncoder
    from ..runinfo import device_name, model_label
    from .corpora import corpus_lengths, make_corpus, random_model
    from .measure import matmul_tflops
    from ..runinfo import check_csv
    from .run import benchmark, format_table, padded_fallback, save_rows

    for name in ("docs", "repeats", "padded_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    check_csv(args.csv)  # before the run, not after it
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtypes = args.dtypes or ([args.dtype] if args.dtype else ["float32", "bfloat16"])
    encoders = {}
    for dt in dtypes:
        # dedup off: end_to_end's encode_documents runs every chunk too (run.py's docstring)
        per_dtype = argparse.Namespace(**{**vars(args), "device": str(device), "dtype": dt, "dedup": False})
        if args.random_model:
            model, tok = random_model(args.random_model, device, getattr(torch, dt))
            encoders[dt] = DiceEncoder(model, tok, **encoder_options(per_dtype))
        else:
            encoders[dt] = make_encoder(per_dtype)
    first = next(iter(encoders.values()))
    padded = {dt: why for dt, enc in encoders.items() if (why := padded_fallback(enc))}
    for dt, why in padded.items():
        print(f"{'FAIL' if args.require_packed else 'NOTE'}: {dt}: {why}", flush=True)
    name = args.random_model or model_label(first.spec.name)
    st_model = None
    if not args.random_model and not args.no_sentence_transformers and "float32" in encoders:
        from sentence_transformers import SentenceTransformer

        st_model = SentenceTransformer(first.spec.name, device=str(device))
    peaks = None
    if args.flops:
        peaks = {dt: matmul_tflops(device, getattr(torch, dt)) for dt in dtypes}
        print("measured matmul rate: " + ", ".join(f"{dt} {p:,.3g} TFLOP/s" for dt, p in peaks.items()), flush=True)
    all_rows = []
    for corpus in args.corpus:
        texts = make_corpus(first.tokenizer, corpus_lengths(corpus, args.docs, args.seed, args.longest), args.seed)
        on_time = _raw_writer(args.raw_csv, dict(device=device_name(device), model=name, corpus=corpus))
        rows = benchmark(encoders, texts, corpus, name, args.repeats, st_model, args.padded_batch, peaks,
                         on_time=on_time, budget_s=args.budget_s, on_rows=lambda r: save_rows(r, args.csv))
        print(format_table(rows), flush=True)
        all_rows += rows
    if len(args.corpus) > 1:
        print(format_table(all_rows))
    print(f"{device_name(device)}; torch {torch.__version__}; {first!r}; rows appended to {args.csv}")
    if padded and args.require_packed:
        print("FAIL: --require-packed: " + "; ".join(f"{dt}: {why}" for dt, why in padded.items()), flush=True)
        return 1
    return 0


def _raw_writer(path, fixed: dict):
    """on_time callback appending (and flushing) one CSV row per timing to ``path``; None without a path."""
    if not path:
        return None
    import datetime

    from ..runinfo import append_csv

    def on_time(name: str, rnd: int, seconds: float) -> None:
        path_name, dt = name.rstrip("]").split("[")
        append_csv([dict(date=datetime.datetime.now().isoformat(timespec="seconds"), **fixed, path=path_name,
                         dtype=dt, round=rnd, seconds=seconds)], path)
        print(f"  {name} round {rnd}: {seconds:.3f} s", flush=True)

    return on_time
