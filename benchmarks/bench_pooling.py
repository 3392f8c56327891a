"""Micro-benchmark of token -> chunk mean pooling: achieved GB/s against the measured copy bandwidth.

    python benchmarks/bench_pooling.py [--csv benchmarks/pooling.csv] [--smoke]

Implementations timed on the same inputs (bf16 hidden states, fp32 outputs):
  triton        dice_fast.ops.triton_pool (CUDA)
  native        the csrc/ CUDA C++ (or CPU C++) twin, built on demand
  index_add     out.index_add_(0, segment_ids, hidden.float()) / counts  (what a user writes)
  segment_reduce torch.segment_reduce(hidden.float(), "mean", lengths=...)
  scatter_reduce out.scatter_reduce_(0, ids, hidden.float(), "mean", include_self=False)
Bytes counted: hidden read once + chunk vectors written once. GPU times are medians of
triton.testing.do_bench (CUDA events); CPU times (--smoke) are medians of a few wall-clock runs.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dice_fast.runinfo import device_name, versions  # noqa: E402
from dice_fast.ops import pool_chunks  # noqa: E402


def timer(device):
    if device.type == "cuda":
        import triton.testing

        def measure(fn):
            med, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8])
            return med * 1e-3, p20 * 1e-3, p80 * 1e-3

        return measure

    def measure(fn, n=5):
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[len(ts) // 2], ts[0], ts[-1]

    return measure


def copy_bandwidth(device, measure, nbytes: int) -> float:
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t, _, _ = measure(lambda: dst.copy_(src))
    return 2 * nbytes / t / 1e9  # read + write


def make_inputs(device, tokens: int, hidden: int, kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "mixed":  # 1..512-token chunks: the DICE tail-heavy mix
        lengths = torch.randint(1, 513, (tokens // 256 + 1,), generator=g)
    elif kind == "long":  # 8192-token chunks
        lengths = torch.full((tokens // 8192 + 1,), 8192)
    else:  # full 256-token chunks
        lengths = torch.full((tokens // 256 + 1,), 256)
    lengths = lengths[torch.cumsum(lengths, 0) <= tokens]
    total = int(lengths.sum())
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    hidden_states = torch.randn(total, hidden, generator=g).to(device=device, dtype=torch.bfloat16)
    return hidden_states, cu.to(device), lengths.to(device)


def composites(hidden, cu, lengths):
    n = len(lengths)
    seg = torch.repeat_interleave(torch.arange(n, device=hidden.device), lengths)
    idx = seg.unsqueeze(1).expand(-1, hidden.shape[1])
    counts = lengths.to(torch.float32).unsqueeze(1)

    def index_add():
        out = torch.zeros(n, hidden.shape[1], device=hidden.device)
        return out.index_add_(0, seg, hidden.float()) / counts

    def segment_reduce():
        return torch.segment_reduce(hidden.float(), "mean", lengths=lengths)

    def scatter_reduce():
        out = torch.zeros(n, hidden.shape[1], device=hidden.device)
        return out.scatter_reduce_(0, idx, hidden.float(), "mean", include_self=False)

    return {"index_add": index_add, "segment_reduce": segment_reduce, "scatter_reduce": scatter_reduce}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", default="benchmarks/pooling.csv")
    ap.add_argument("--smoke", action="store_true", help="small sizes (CPU check of the script itself)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    measure = timer(device)
    impls = {}
    if device.type == "cuda":
        impls["triton"] = "triton"
    try:
        from dice_fast.ops import native

        native.build(with_cuda=device.type == "cuda")
        impls["native"] = "native"
    except Exception as exc:  # the twin is optional: say why it is missing and go on
        print(f"native extension not built: {exc}", file=sys.stderr)
    bw = copy_bandwidth(device, measure, (1 << 24) if args.smoke else (1 << 30))
    sizes = [(1 << 14, 384, "mixed")] if args.smoke else [
        (1 << 20, 384, "mixed"), (1 << 20, 1024, "mixed"), (1 << 18, 4096, "mixed"),
        (1 << 18, 4096, "long"), (1 << 18, 8192, "full"),
    ]
    rows, now, v = [], datetime.datetime.now().isoformat(timespec="seconds"), versions()
    for tokens, hidden, kind in sizes:
        h, cu, lengths = make_inputs(device, tokens, hidden, kind)
        nbytes = h.numel() * h.element_size() + (len(lengths)) * hidden * 4
        fns = {name: (lambda which=which: pool_chunks(h, cu, "mean", impl=which)) for name, which in impls.items()}
        fns.update(composites(h, cu, lengths))
        want = fns["index_add"]()
        for name, fn in fns.items():
            got = fn()
            err = float((got - want).abs().max())
            t, p20, p80 = measure(fn)
            rows.append(dict(date=now, device=device_name(device), **v, impl=name, tokens=h.shape[0], hidden=hidden,
                             chunks=len(lengths), kind=kind, ms=t * 1e3, p20_ms=p20 * 1e3, p80_ms=p80 * 1e3,
                             gbps=nbytes / t / 1e9, copy_gbps=bw, pct_of_copy=100 * nbytes / t / 1e9 / bw,
                             max_abs_err_vs_index_add=err))
    best = {}
    for r in rows:
        if r["impl"] in ("index_add", "segment_reduce", "scatter_reduce"):
            key = (r["tokens"], r["hidden"], r["kind"])
            best[key] = min(best.get(key, float("inf")), r["ms"])
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with open(out, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) + ["speedup_vs_best_composite"])
        if new:
            w.writeheader()
        for r in rows:
            r["speedup_vs_best_composite"] = best[(r["tokens"], r["hidden"], r["kind"])] / r["ms"]
            w.writerow(r)
    print(f"\ncopy bandwidth {bw:,.0f} GB/s on {device_name(device)}")
    print("| tokens | hidden | chunks | impl | ms | GB/s | % of copy | vs best composite | max err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tokens']} | {r['hidden']} | {r['kind']} {r['chunks']} | {r['impl']} | {r['ms']:.3f} | "
              f"{r['gbps']:,.0f} | {r['pct_of_copy']:.0f}% | {r['speedup_vs_best_composite']:.2f}x | "
              f"{r['max_abs_err_vs_index_add']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
