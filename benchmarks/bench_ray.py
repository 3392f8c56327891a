"""The Ray Data path (1 and 2 actors) against the single-process CLI, on one Parquet corpus.

    python benchmarks/bench_ray.py [--corpus mixed] [--docs 120] [--actors 1 2] [--repeats 3]
                                   [--batch-size 8] [--csv benchmarks/ray_results.csv] [--smoke]

Paths, same model (the bundled all-MiniLM-L6-v2 unless --model), options, dtype and corpus:
  cli     ``python -m dice_fast.cli encode DIR -o OUT.parquet`` in a fresh process (torch uses all
          --cores threads)
  ray-N   ``encode_dataset(read_parquet(DIR), concurrency=N, num_cpus=cores // N)`` +
          ``write_parquet``, on a local Ray cluster started once before timing (``num_cpus = cores +
          1``: one logical CPU left for the read and write tasks); each actor gets
          ``OMP_NUM_THREADS = cores // N`` threads from Ray.

Each timed run is a whole job: process start / actor start, model load, reading, encoding and
writing Parquet. The fixed part is measured too: the same job on a 2-document corpus (``startup_s``),
so ``steady tokens/s = tokens / (wall - startup)``. Rounds are interleaved (cli, ray-1, ray-2, cli,
..., each path's 2-document job just before its full job) after one warm-up round of 2-document
jobs; medians are reported. Every Ray output is checked against
the CLI's vectors (max abs difference, matched by id). Rows are appended to the CSV.

The corpus: ``dice_fast.bench.corpora`` (real prose cut to token lengths, seed 0), written as
``--files`` Parquet files (documents dealt round-robin), repartitioned into that many blocks after
reading, so every actor gets work; ``--batch-size`` documents per actor call.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dice_fast.runinfo import append_csv, device_name, model_label, versions  # noqa: E402

FIELDS = ["date", "device", "device_name", "model", "corpus", "docs", "tokens", "path", "actors", "threads",
          "batch_size", "chunk_size", "max_batch_tokens", "repeats", "wall_s", "wall_p20_s", "wall_p80_s",
          "startup_s", "docs_per_s", "tokens_per_s", "steady_tokens_per_s", "max_abs_diff_vs_cli", "torch",
          "transformers", "ray", "dice_fast"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="mixed", choices=("mixed", "short", "long"))
    p.add_argument("--docs", type=int, default=120)
    p.add_argument("--longest", type=int, default=16384, help="longest document of the corpus (tokens)")
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="documents per actor call")
    p.add_argument("--files", type=int, default=8, help="Parquet files (and read blocks) of the corpus")
    p.add_argument("--cores", type=int, default=os.cpu_count())
    p.add_argument("--model", default=None, help="model folder (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--csv", default="benchmarks/ray_results.csv")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round, no CSV: checks the script works")
    args = p.parse_args(argv)
    if args.smoke:
        args.docs, args.longest, args.repeats, args.files, args.batch_size, args.csv = 8, 1024, 1, 4, 2, None
    return args


def write_corpus(args, tokenizer, root: Path, n_docs: int, files: int) -> tuple[list[str], int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dice_fast.bench.corpora import corpus_lengths, make_corpus

    lengths = corpus_lengths(args.corpus, n_docs, seed=0, longest=args.longest)
    texts = make_corpus(tokenizer, lengths, seed=0)
    ids = [f"doc{i:06d}" for i in range(len(texts))]
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        pq.write_table(pa.table({"id": ids[f::files], "text": texts[f::files]}), root / f"part-{f:03d}.parquet")
    tokens = sum(len(t) for t in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return ids, tokens


def options(args) -> dict:
    out = {"device": "cpu", "dtype": "float32"}
    if args.chunk_size:
        out["chunk_size"] = args.chunk_size
    if args.max_batch_tokens:
        out["max_batch_tokens"] = args.max_batch_tokens
    return out


def run_cli(args, src: Path, out: Path) -> float:
    cmd = [sys.executable, "-m", "dice_fast.cli", "encode", str(src), "-o", str(out), "--id-field", "id",
           "--quiet", "--overwrite", "--device", "cpu", "--dtype", "float32"]
    if args.model:
        cmd += ["--model", args.model]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    if args.max_batch_tokens:
        cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def run_ray(args, src: Path, out: Path, actors: int, files: int) -> float:
    import ray

    from dice_fast.integrations.ray import encode_dataset

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    # small files are read into one block (override_num_blocks does not split a file): repartition so that
    # every actor gets work
    ds = ray.data.read_parquet(str(src)).repartition(files)
    encode_dataset(ds, args.model, concurrency=actors, num_cpus=max(1, args.cores // actors),
                   batch_size=args.batch_size, **options(args)).write_parquet(str(out))
    return time.perf_counter() - t0


def read_vectors(path: Path) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["id", "embedding"])
    col = t.column("embedding").combine_chunks()
    vecs = col.flatten().to_numpy().reshape(len(col), -1)
    return dict(zip(t.column("id").to_pylist(), vecs))


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray
    import torch

    from dice_fast import DiceEncoder

    enc = DiceEncoder.from_pretrained(args.model, **options(args))
    work = Path(tempfile.mkdtemp(prefix="bench_ray_"))
    ids, tokens = write_corpus(args, enc.tokenizer, work / "corpus", args.docs, args.files)
    write_corpus(args, enc.tokenizer, work / "tiny", 2, 2)
    print(f"corpus {args.corpus}: {len(ids)} documents, {tokens:,} tokens, {args.files} files; {enc}", flush=True)

    ray.init(num_cpus=args.cores + 1, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.wait_for_min_actors_s = 600  # a fixed pool is fully up before the first batch
    paths = ["cli"] + [f"ray-{a}" for a in args.actors]

    def run(path: str, src: Path, out: Path, files: int) -> float:
        if path == "cli":
            return run_cli(args, src, out)
        return run_ray(args, src, out, int(path.split("-")[1]), files)

    try:
        for p in paths:  # warm-up: worker processes, file caches
            run(p, work / "tiny", work / f"tiny-{p}{'.parquet' if p == 'cli' else ''}", 2)
        walls: dict[str, list[float]] = {p: [] for p in paths}
        starts: dict[str, list[float]] = {p: [] for p in paths}
        for r in range(args.repeats):
            for p in paths:
                suffix = ".parquet" if p == "cli" else ""
                starts[p].append(run(p, work / "tiny", work / f"tiny-{p}{suffix}", 2))
                walls[p].append(run(p, work / "corpus", work / f"out-{p}{suffix}", args.files))
                print(f"round {r + 1}/{args.repeats} {p}: {walls[p][-1]:.1f} s (2-document job {starts[p][-1]:.1f} s)",
                      flush=True)
        startup = {p: statistics.median(v) for p, v in starts.items()}
        ref = read_vectors(work / "out-cli.parquet")
        diffs = {"cli": 0.0}
        for p in paths[1:]:
            got = read_vectors(work / f"out-{p}")
            assert sorted(got) == sorted(ref), f"{p}: ids differ from the CLI's"
            diffs[p] = float(max(np.abs(got[i] - ref[i]).max() for i in ref))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    ver = versions()
    rows = []
    for p in paths:
        w = walls[p]
        wall = statistics.median(w)
        actors = 0 if p == "cli" else int(p.split("-")[1])
        rows.append({
            "date": date, "device": "cpu", "device_name": device_name(torch.device("cpu")),
            "model": model_label(enc.spec.name), "corpus": args.corpus, "docs": len(ids), "tokens": tokens,
            "path": p, "actors": actors, "threads": args.cores if p == "cli" else max(1, args.cores // actors),
            "batch_size": "" if p == "cli" else args.batch_size, "chunk_size": enc.config.chunk_size,
            "max_batch_tokens": enc.max_batch_tokens, "repeats": len(w), "wall_s": round(wall, 3),
            "wall_p20_s": round(float(np.percentile(w, 20)), 3), "wall_p80_s": round(float(np.percentile(w, 80)), 3),
            "startup_s": round(startup[p], 3), "docs_per_s": round(len(ids) / wall, 2),
            "tokens_per_s": round(tokens / wall, 1),
            "steady_tokens_per_s": round(tokens / (wall - startup[p]), 1) if wall > startup[p] else "",
            "max_abs_diff_vs_cli": f"{diffs[p]:.2e}", "ray": ray.__version__, **ver,
        })
    print("\n| path | threads | wall s | startup s | docs/s | tokens/s | steady tokens/s | vs cli | max abs diff vs cli |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = rows[0]["wall_s"]
    for row in rows:
        print(f"| {row['path']} | {row['threads']} | {row['wall_s']:.1f} | {row['startup_s']:.1f} | {row['docs_per_s']} | "
              f"{row['tokens_per_s']:,} | {row['steady_tokens_per_s']} | {base / row['wall_s']:.2f}× | "
              f"{row['max_abs_diff_vs_cli']} |")
    if args.csv:
        append_csv(rows, args.csv, FIELDS)
        print(f"appended {len(rows)} rows to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
