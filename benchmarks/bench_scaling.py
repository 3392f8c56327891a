"""Corpus scaling of the streaming engine: 1x, 5x and 20x the same mixed corpus, fed as a generator.

    python benchmarks/bench_scaling.py                      # bundled MiniLM, CPU float32
    python benchmarks/bench_scaling.py --docs 40 --scales 1,5,20 --dtype bfloat16

Each scale runs in a fresh subprocess that loads the model, warms up on the base corpus, then
encodes ``scale`` copies of it from a generator (the corpus is never held as a list) with
`DiceEncoder.stream_documents`, keeping only a running checksum of the vectors. Reported per scale:
documents, tokens, seconds, tokens/s, the time ratio to 1x divided by the scale (1.0 = linear), and
the peak resident memory above the level after warm-up (flat = memory independent of the corpus).
Rows are appended to ``--csv`` with date, device and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path


def child(args) -> dict:
    import numpy as np
    import torch

    from dice_fast import DiceEncoder
    from dice_fast.bench.corpora import corpus_lengths, make_corpus
    from dice_fast.bench.measure import PeakMemory

    torch.manual_seed(0)
    enc = DiceEncoder.from_pretrained(args.model, device="cpu", dtype=args.dtype)
    base = make_corpus(enc.tokenizer, corpus_lengths("mixed", args.docs, seed=0, longest=args.longest))
    enc.encode_documents(base)  # warm-up: kernels, caches, lazy imports

    def corpus():
        for _ in range(args.scale):
            yield from base

    tokens = 0

    def progress(docs, toks):
        nonlocal tokens
        tokens += toks

    checksum, rows = 0.0, 0
    with PeakMemory(torch.device("cpu")) as mem:
        t0 = time.perf_counter()
        for block in enc.stream_documents(corpus(), progress=progress):
            checksum += float(np.abs(block).sum())
            rows += len(block)
        seconds = time.perf_counter() - t0
    return {"scale": args.scale, "documents": rows, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "peak_mb": mem.peak, "checksum_per_row": checksum / max(rows, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--docs", type=int, default=40, help="documents in the base (1x) corpus")
    p.add_argument("--longest", type=int, default=4096, help="longest document of the mixed corpus, tokens")
    p.add_argument("--scales", default="1,5,20")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--csv", default="benchmarks/scaling.csv")
    p.add_argument("--scale", type=int, default=None, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()
    if args.scale is not None:
        print(json.dumps(child(args)))
        return 0

    from dice_fast.runinfo import append_csv, device_name, versions

    rows = []
    for scale in (int(s) for s in args.scales.split(",")):
        cmd = [sys.executable, __file__, "--docs", str(args.docs), "--longest", str(args.longest),
               "--dtype", args.dtype, "--scale", str(scale)] + (["--model", args.model] if args.model else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
        print(f"scale {scale}: {rows[-1]}", flush=True)
    first = rows[0]
    info = {"date": datetime.date.today().isoformat(), "device": device_name("cpu"), "dtype": args.dtype,
            **versions()}
    for r in rows:
        r["time_per_scale_vs_1x"] = (r["seconds"] / r["scale"]) / (first["seconds"] / first["scale"])
        r.update(info)
    append_csv(rows, Path(args.csv))
    print("| scale | documents | tokens | seconds | tokens/s | time/scale vs 1x | peak MB above warm |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['scale']}x | {r['documents']:,} | {r['tokens']:,} | {r['seconds']:.1f} | {r['tokens_per_s']:,.0f} "
              f"| {r['time_per_scale_vs_1x']:.2f} | {r['peak_mb']:.0f} |")
    print(f"{info['device']}; {info}")
    checks = {round(r["checksum_per_row"], 4) for r in rows}
    if len(checks) != 1:
        print(f"WARNING: per-row checksum differs between scales: {checks}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
