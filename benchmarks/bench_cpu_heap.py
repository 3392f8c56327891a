"""The CPU heap policy end to end: the engine with glibc's thresholds kept (dice_fast's default) vs
glibc's own adaptive policy (``DICE_FAST_CPU_HEAP=default``), in alternating fresh processes.

    python benchmarks/bench_cpu_heap.py                    # bundled MiniLM, mixed corpus, 4 rounds
    python benchmarks/bench_cpu_heap.py --path batches     # batches back to back, as a loaded server
    python benchmarks/bench_cpu_heap.py --rounds 6 --max-batch-tokens 8192
    python benchmarks/bench_cpu_heap.py --path batches --modes keep,keep_trim   # the server's busy trim

glibc's policy is per process and cannot be unset, so each mode runs in its own process; the two
alternate (keep, default, keep, default, ...) so slow drift of a shared machine falls on both.
Each process loads the model, warms up once, then times ``--repeats`` passes over the same corpus
(median), counting minor page faults and system CPU time: calls of `DiceEncoder.encode_documents`
(``--path encode``), or the pre-tokenized corpus's batches back to back (``--path batches``). Reported: per mode the median over rounds, and the median of the per-round ratios
default / keep (> 1: keeping pages is faster). Mode ``keep_trim`` keeps the pages but hands them back
after every timed pass (inside the timing), as the server's worker does every ``BUSY_TRIM_S`` under
steady load: its ratio to ``keep`` is the cost of that trim at one trim per pass. Rows are appended to
``--csv``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("keep", "default", "keep_trim")  # keep_trim: keep, and trim after each pass


def child(args) -> dict:
    import resource

    import torch

    from dice_fast import DiceEncoder, cpu_heap
    from dice_fast.bench.corpora import corpus_lengths, make_corpus

    enc = DiceEncoder.from_pretrained(args.model, device="cpu", max_batch_tokens=args.max_batch_tokens)
    texts = make_corpus(enc.tokenizer, corpus_lengths("mixed", args.docs, seed=0, longest=args.longest))
    plan = enc.plan(texts)
    tokens = int(plan.chunk_lengths.sum())
    if args.path == "encode":
        def run():
            enc.encode_documents(texts)
    else:  # the engine's batches back to back, no per-window trim: a server under steady load
        from dice_fast.bench.run import encode_plan

        def run():
            encode_plan(enc, plan)
    if args.trim_each_pass:
        inner = run

        def run():
            inner()
            cpu_heap.release_freed_memory()
    run()  # warm-up
    times, faults, system = [], [], []
    for _ in range(args.repeats):
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(after.ru_minflt - before.ru_minflt)
        system.append(after.ru_stime - before.ru_stime)
    return {"mode": os.environ.get(cpu_heap.ENV, "keep") + ("_trim" if args.trim_each_pass else ""), "applied": cpu_heap.keep_freed_pages(),
            "tokens": tokens, "seconds": statistics.median(times), "minor_faults": statistics.median(faults),
            "system_s": statistics.median(system), "threads": torch.get_num_threads()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--docs", type=int, default=40)
    p.add_argument("--longest", type=int, default=8192, help="longest document of the mixed corpus, tokens")
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--path", choices=("encode", "batches"), default="encode",
                   help="encode: encode_documents (tokenize, batches, trim after the window); batches: the "
                        "pre-tokenized corpus's batches back to back (a server under steady load)")
    p.add_argument("--rounds", type=int, default=4, help="keep/default process pairs")
    p.add_argument("--repeats", type=int, default=3, help="timed encodes per process")
    p.add_argument("--modes", default="keep,default", help=f"comma-separated, of {', '.join(MODES)}; the "
                   "first is the baseline of the ratios (default keep,default)")
    p.add_argument("--csv", default="benchmarks/cpu_heap.csv")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trim-each-pass", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    modes = args.modes.split(",")
    if len(modes) < 2 or not set(modes) <= set(MODES):
        p.error(f"--modes: two or more of {', '.join(MODES)}, got {args.modes!r}")
    if args.child:
        print(json.dumps(child(args)))
        return 0

    from dice_fast.runinfo import append_csv, device_name, versions

    cmd = [sys.executable, __file__, "--child", "--docs", str(args.docs), "--longest", str(args.longest),
           "--repeats", str(args.repeats), "--path", args.path]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--max-batch-tokens", str(args.max_batch_tokens)] if args.max_batch_tokens else []
    info = {"date": datetime.date.today().isoformat(), "device": device_name("cpu"), **versions()}
    rows = []
    for rnd in range(args.rounds):
        for mode in modes:
            env = dict(os.environ, **{"DICE_FAST_CPU_HEAP": mode.removesuffix("_trim")})
            extra = ["--trim-each-pass"] if mode.endswith("_trim") else []
            out = subprocess.run(cmd + extra, env=env, check=True, capture_output=True, text=True).stdout
            row = dict(json.loads(out.strip().splitlines()[-1]), round=rnd, path=args.path, **info)
            rows.append(row)
            print(f"round {rnd} {mode:>7}: {row['seconds']:.2f} s, {row['tokens'] / row['seconds']:,.0f} tokens/s, "
                  f"{row['minor_faults']:,.0f} minor faults, {row['system_s']:.2f} s system", flush=True)
    append_csv(rows, Path(args.csv))
    by = {m: [r for r in rows if r["mode"] == m] for m in modes}
    print("| heap policy | median s | tokens/s | minor faults per encode | system s per encode |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for m in modes:
        s = statistics.median(r["seconds"] for r in by[m])
        print(f"| {m} | {s:.2f} | {by[m][0]['tokens'] / s:,.0f} | {statistics.median(r['minor_faults'] for r in by[m]):,.0f} "
              f"| {statistics.median(r['system_s'] for r in by[m]):.2f} |")
    for m in modes[1:]:
        ratios = [o["seconds"] / b["seconds"] for b, o in zip(by[modes[0]], by[m])]
        print(f"{m} / {modes[0]} time, per round: {', '.join(f'{r:.3f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.3f}")
    print(f"{info['device']}; {info}")
    return 0 if all(r["applied"] == r["mode"].startswith("keep") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
