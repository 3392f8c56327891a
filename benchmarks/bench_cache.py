"""Chunk reuse, the issue's three targets, measured in one run with interleaved repetitions.

    python benchmarks/bench_cache.py                          # bundled MiniLM, 200 mixed documents, 3 reps
    python benchmarks/bench_cache.py --docs 400 --reps 5 --csv benchmarks/cache.csv
    python benchmarks/bench_cache.py --docs 12 --longest 600 --reps 1 --csv /tmp/x.csv   # a smoke run

1. **Re-indexing** (``reindex``): ``dice-fast encode CORPUS -o DIR/ --cache C`` end to end (model load
   included) on a cold cache, then the same job over the corpus with ``--edit-fraction`` of its
   documents edited (a sentence inserted mid-document, so the chunk boundaries after it shift), with the
   same cache. Target: cold / warm >= 5, and the warm output equal to a run without cache (max abs
   error <= 1e-5; the no-cache run of the edited corpus is timed too).
2. **Half duplicates** (``duplicates``): one ``encode_documents`` call, no cache option, over N documents
   of which the second half copies the first (shuffled), against N unique documents whose second half has
   the first half's lengths (so both corpora hold the same tokens, give or take a few per document).
   Target: unique / duplicated >= 1.6 (tokens/s are reported too).
3. **No duplicates** (``overhead``): ``encode_documents`` over unique documents with reuse off (the
   baseline: the option ``dedup=False``) against the default (dedup on) with a cold persistent cache
   written as it goes. Target: cached / plain - 1 <= 3 %.

Within each repetition the modes alternate, so drift of a shared machine falls on all of them; each
ratio is formed within a repetition and the median over repetitions is reported. Rows go to ``--csv``
(`dice_fast.runinfo.append_csv`); a short table is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

EDIT = " An inserted sentence changes this document from here on. "


def edited(docs: list[str], fraction: float, seed: int) -> tuple[list[str], int]:
    """``docs`` with ``fraction`` of them (at least one) given a sentence in the middle."""
    rng = random.Random(seed)
    n = max(1, round(fraction * len(docs)))
    out = list(docs)
    for i in rng.sample(range(len(docs)), n):
        mid = out[i].find(" ", len(out[i]) // 2)
        mid = len(out[i]) if mid < 0 else mid
        out[i] = out[i][:mid] + EDIT + out[i][mid:]
    return out, n


def run_job(args, src: Path, out: Path, cache: Path | None) -> tuple[float, dict]:
    """``dice-fast encode`` in this process (the model loaded as the command does); (seconds, summary)."""
    from dice_fast.cli import main

    argv = ["encode", str(src), "-o", str(out) + "/", "-q", "--overwrite"]
    if args.model:
        argv += ["--model", args.model]
    if cache is not None:
        argv += ["--cache", str(cache)]
    sink = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sink):
        rc = main(argv)
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"dice-fast encode failed ({rc}): {sink.getvalue()}")
    return seconds, json.loads((out / "manifest.json").read_text())["summary"]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--docs", type=int, default=200, help="documents per corpus (default 200)")
    p.add_argument("--corpus", choices=("mixed", "short", "long"), default="mixed")
    p.add_argument("--longest", type=int, default=2048, help="longest document in tokens (default 2048)")
    p.add_argument("--edit-fraction", type=float, default=0.05, help="documents edited for re-indexing (default 0.05)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--targets", default="reindex,duplicates,overhead")
    p.add_argument("--csv", default="benchmarks/cache.csv", help="append rows here ('' for none)")
    args = p.parse_args(argv)

    import torch

    from dice_fast import DiceEncoder
    from dice_fast.bench.corpora import corpus_lengths, make_corpus
    from dice_fast.models import default_model_path
    from dice_fast.runinfo import append_csv, device_name, model_label, versions

    targets = args.targets.split(",")
    enc = DiceEncoder.from_pretrained(args.model, device="cpu")
    lengths = corpus_lengths(args.corpus, args.docs, seed=0, longest=args.longest)
    # the second half of `unique` has the first half's lengths with other words, so the half-duplicate
    # corpus (the first half twice) and `unique` hold the same number of tokens per document
    half = make_corpus(enc.tokenizer, lengths[: (args.docs + 1) // 2], seed=0)
    unique = half + make_corpus(enc.tokenizer, lengths[: args.docs // 2], seed=1)
    dup = half + half[: args.docs // 2]
    random.Random(1).shuffle(dup)
    tokens_dup, tokens_unique = (int(enc.plan(texts).chunk_lengths.sum()) for texts in (dup, unique))
    base = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device_name(enc.device), **versions(),
            "model": model_label(args.model or default_model_path()), "corpus": args.corpus, "docs": args.docs,
            "threads": torch.get_num_threads()}
    rows, ratios = [], {t: [] for t in targets}
    work = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    try:
        src = write_jsonl(work / "corpus.jsonl", unique)
        changed, n_edited = edited(unique, args.edit_fraction, seed=2)
        src_edit = write_jsonl(work / "edited.jsonl", changed)
        enc.encode_documents(unique[:8])  # warm-up
        for rep in range(args.reps):
            if "reindex" in targets:
                from dice_fast.corpus import load_embeddings

                cache = work / f"cache{rep}"
                cold, s_cold = run_job(args, src, work / "cold", cache)
                warm, s_warm = run_job(args, src_edit, work / "warm", cache)
                plain, _ = run_job(args, src_edit, work / "plain", None)
                err = float(np.abs(load_embeddings(work / "warm")[1] - load_embeddings(work / "plain")[1]).max())
                size = sum(f.stat().st_size for f in cache.iterdir())
                ratios["reindex"].append(cold / warm)
                for mode, sec, s in (("cold", cold, s_cold), ("warm_edited", warm, s_warm), ("no_cache_edited", plain, None)):
                    rows.append({**base, "target": "reindex", "mode": mode, "rep": rep, "seconds": round(sec, 4),
                                 "edited_docs": n_edited, "chunks_computed": s and s["chunks_computed"],
                                 "chunks_from_cache": s and s["chunks_from_cache"], "max_abs_err": err,
                                 "cache_bytes": size, "ratio": round(cold / warm, 3) if mode == "warm_edited" else ""})
                shutil.rmtree(cache)
            if "duplicates" in targets:
                t_dup, _ = timed(lambda: enc.encode_documents(dup))
                t_uni, _ = timed(lambda: enc.encode_documents(unique))
                ratios["duplicates"].append(t_uni / t_dup)
                for mode, sec, n in (("half_duplicates", t_dup, tokens_dup), ("unique", t_uni, tokens_unique)):
                    rows.append({**base, "target": "duplicates", "mode": mode, "rep": rep, "seconds": round(sec, 4),
                                 "tokens": n, "tokens_per_s": round(n / sec, 1),
                                 "ratio": round(t_uni / t_dup, 3) if mode == "half_duplicates" else ""})
            if "overhead" in targets:
                plain = DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(dedup=False))
                t_plain, _ = timed(lambda: plain.encode_documents(unique))
                cached = DiceEncoder(enc.model, enc.tokenizer, config=enc.config, cache=work / f"cold{rep}")
                cached.encode_documents(["A warm-up for this encoder, not part of the corpus."])
                before = cached.chunk_stats.snapshot()
                t_cached, _ = timed(lambda: cached.encode_documents(unique))
                stats = cached.chunk_stats.snapshot()
                ratios["overhead"].append(t_cached / t_plain - 1)
                for mode, sec in (("no_reuse", t_plain), ("dedup_cold_cache", t_cached)):
                    rows.append({**base, "target": "overhead", "mode": mode, "rep": rep, "seconds": round(sec, 4),
                                 "tokens": tokens_unique, "deduplicated": stats["deduplicated"] - before["deduplicated"],
                                 "overhead": round(t_cached / t_plain - 1, 4) if mode == "dedup_cold_cache" else ""})
                cached.cache.cache.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.csv:
        append_csv(rows, args.csv)
    goals = {"reindex": ("cold / warm (5 % edited)", ">= 5"), "duplicates": ("unique / half-duplicate", ">= 1.6"),
             "overhead": ("dedup + cold cache cost", "<= 0.03")}
    print(f"{'target':<12} {'measure':<28} {'median':>8}  {'reps':<24} goal")
    for t in targets:
        r = ratios[t]
        print(f"{t:<12} {goals[t][0]:<28} {statistics.median(r):>8.3f}  {' '.join(f'{x:.3f}' for x in r):<24} {goals[t][1]}")
    if "reindex" in targets:
        print(f"reindex: warm output vs no cache, max abs error {max(r['max_abs_err'] for r in rows if r['target'] == 'reindex'):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
