"""Per-call latency on the CPU: one text a call, dice_fast against the peers of benchmarks/bench_peers.py.

    bash benchmarks/peers_env.sh                      # once: the peers' own venv (their pins conflict)
    python benchmarks/bench_latency.py                # ~5 min on 2 quiet cores once exports are cached
    python benchmarks/bench_latency.py --calls 40 --rounds 3 --csv benchmarks/latency.csv

What a search service pays for each query it embeds, and an indexer for each short document: every
path encodes the same texts one call each, back to back, in three sizes cut from the held-out half of
the bundled prose: queries of 10 tokens (dice_fast's ``encode_queries``), passages of 62 and chunks of
254 tokens (``encode_documents``: one chunk each; 12, 64 and 256 tokens with [CLS] and [SEP]). Rounds
interleave the paths (order rotated each round); the median and 90th percentile are over every call of
every round, after a warm-up of a few calls per path and size. Agreement: cosine of every text's vector
against sentence-transformers' PyTorch fp32 one (the same text, one window: the same vector to float
rounding). The paths are bench_peers.py's (dice_fast's float32 eager, compiled, on OpenVINO, and
bf16 / int8 where the CPU runs them; sentence-transformers on PyTorch, ONNX Runtime and OpenVINO).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_peers import add_path_options, dice_paths, open_peers, write_rows  # noqa: E402

SIZES = {"query": 10, "passage": 62, "chunk": 254}  # text tokens of each size (+ [CLS], [SEP])
WARMUP_CALLS = 3
REFERENCE = "st_torch_fp32"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--calls", type=int, default=30, help="texts of each size, one call each, per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every path once each)")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    add_path_options(ap, HERE / "latency.csv")
    return ap.parse_args(argv)


def dice_calls(enc, size: str):
    """A function encoding texts one call each with ``enc``: (every call's seconds, (n, dim) vectors)."""
    encode = enc.encode_queries if size == "query" else enc.encode_documents

    def each(texts):
        seconds, vecs = [], []
        for text in texts:
            t0 = time.perf_counter()
            out = encode([text])
            seconds.append(time.perf_counter() - t0)
            vecs.append(out[0])
        return seconds, np.asarray(vecs, np.float32)
    return each


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from dice_fast.data import prose_halves, token_windows
    from dice_fast.models import default_model_path
    from dice_fast.quant import cosines, held_out_texts
    from dice_fast.runinfo import cpu_model, versions

    model_dir = default_model_path()
    tok = AutoTokenizer.from_pretrained(model_dir)
    held_out = "\n\n".join(prose_halves()[1])
    texts = {size: token_windows(tok, held_out, args.calls + WARMUP_CALLS, SIZES[size]) for size in args.sizes}
    load0 = os.getloadavg()
    peers, peer_skipped, peer_versions = open_peers(args, model_dir, tok, held_out_texts(tok, 8, 254))
    encoders, dice_skipped = dice_paths(args.skip)
    runs = {name: (lambda size, texts, name=name: peers.each(name, texts))
            for name in (peers.ready["peers"] if peers else []) if name not in args.skip}
    runs.update({name: (lambda size, texts, enc=enc: dice_calls(enc, size)(texts)) for name, enc in encoders.items()})
    reference = REFERENCE if REFERENCE in runs else next((n for n in ("dice_fp32", *runs) if n in runs), "")
    if not reference:
        raise SystemExit(f"nothing ran: {peer_skipped} {dice_skipped}")
    print(f"load average {load0[0]:.1f}; paths {list(runs)}", flush=True)

    seconds = {(n, s): [] for n in runs for s in args.sizes}
    vectors = {}
    order = list(runs)
    for size in args.sizes:
        for name in order:  # first-call costs (compiles, thread pools, a compiled path's new shapes) paid here
            runs[name](size, texts[size][:WARMUP_CALLS])
    for r in range(args.rounds):
        for size in args.sizes:
            for name in order[r % len(order):] + order[: r % len(order)]:
                each, vectors[name, size] = runs[name](size, texts[size][WARMUP_CALLS:])
                seconds[name, size] += each
                print(f"  round {r + 1}/{args.rounds} {size:7s} {name}: median {np.median(each) * 1e3:.2f} ms", flush=True)
    peers and peers.close()
    load1 = os.getloadavg()

    when = datetime.datetime.now().isoformat(timespec="seconds")
    ours, rows = versions(), []
    print(f"\n| size | path | median ms | p90 ms | {reference} / path | cos min |\n|---|---|---:|---:|---:|---:|")
    for size in args.sizes:
        base = float(np.median(seconds[reference, size]))
        for name in order:
            calls = np.asarray(seconds[name, size])
            med, p90 = float(np.median(calls)), float(np.percentile(calls, 90))
            cos = cosines(vectors[name, size], vectors[reference, size])
            print(f"| {size} ({SIZES[size] + 2} tokens) | {name} | {med * 1e3:.2f} | {p90 * 1e3:.2f} | "
                  f"{base / med:.2f} | {cos.min():.5f} |")
            rows.append({"date": when, "machine": f"{cpu_model()} ({os.cpu_count()} cores)", "path": name,
                         "size": size, "tokens": SIZES[size] + 2, "calls": len(calls), "median_ms": med * 1e3,
                         "p90_ms": p90 * 1e3, "x_reference": base / med, "reference": reference,
                         "cos_min": float(cos.min()), "load_start": round(load0[0], 2), "load_end": round(load1[0], 2),
                         "versions": json.dumps(peer_versions if name.startswith("st_") else ours, sort_keys=True)})
    write_rows(rows, args.csv, {**peer_skipped, **dice_skipped}, (load0[0], load1[0]), peer_versions, cells="| ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
