"""Micro-benchmark of token -> chunk mean pooling: achieved GB/s against the measured copy bandwidth.

    python benchmarks/bench_pooling.py [--csv benchmarks/pooling.csv] [--smoke] [--native build|skip]
                                       [--budget-s 40] [--plan]

Implementations timed on the same inputs (bf16 hidden states, fp32 outputs):
  triton         dice_fast.ops.triton_pool (CUDA)
  native         the csrc/ CUDA C++ (or CPU C++) twin (``--native build``: built or loaded from its cache)
  torch          dice_fast.ops.torch_pool, the vectorised PyTorch default without the twin
  index_add      out.index_add_(0, segment_ids, hidden.float()) / counts  (what a user writes)
  segment_reduce torch.segment_reduce(hidden.float(), "mean", lengths=...)
  scatter_reduce out.scatter_reduce_(0, ids, hidden.float(), "mean", include_self=False)

Inputs are generated on the device (a few GB of random bf16 in milliseconds, not minutes of CPU
random numbers). Cases: chunks of 258 rows (the default DICE chunk: 256 tokens + 2 specials, one
row past a 256-row piece: the worst case of the Triton kernel's pieces) at MiniLM's and BERT-base's
width, the tail-heavy mix of 1-512 rows, 8192-row chunks, and 512-row chunks at Qwen2-1.5B's width.
Bytes counted: hidden read once + chunk vectors written once. GPU times: CUDA-graph replays (median,
``triton.testing.do_bench_cudagraph``) when every implementation of a case can be captured, else CUDA
events around back-to-back calls (``triton.testing.do_bench``) for all of them: one timer per case, so
no ratio sets a graph replay (no launch gaps) against event timing (``segment_reduce`` runs with
``unsafe=True``: its length check syncs with the host, which breaks capture); CPU (--smoke): median
of a few wall-clock runs. Every case's rows are appended to the CSV (and printed) as soon as it is
measured, so a run stopped by a time limit keeps what it measured; cases that would not fit
``--budget-s`` are skipped and listed. ``--plan`` prints the cases, their bytes and the planned time,
and exits.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dice_fast.ops import pool_chunks  # noqa: E402
from dice_fast.runinfo import append_csv, device_name, versions  # noqa: E402

# (tokens, hidden, kind); kinds: cNNN = every chunk NNN rows, mixed = 1..512 rows, long = 8192 rows
GPU_CASES = [
    (1 << 20, 384, "c258"),  # (BERT-base's 768 lies between this and the 1536 case: dropped to fit the
    (1 << 18, 4096, "mixed"),
    (1 << 18, 4096, "long"),
    (1 << 19, 1536, "c512"),  # compiled forward's A/B in gpu_check.sh's 8 minutes, issue 26)
]
SMOKE_CASES = [(1 << 14, 384, "mixed"), (1 << 13, 384, "c258")]
COMPOSITES = ("index_add", "segment_reduce", "scatter_reduce")
# per implementation and case (triton.testing arguments are milliseconds): a graph of ~GRAPH_REP_MS of
# calls replayed 10 times (median of the 10); without a graph, events around EVENT_REP_MS of calls
GRAPH_REP_MS, WARMUP_MS, EVENT_REP_MS = 20, 25, 150
# planned seconds per (case, implementation) beyond the timed replays: the estimate calls, graph
# capture, the correctness call, allocation; and per Triton compilation (two kernels per case: the
# reduction and the finalize pass of chunks longer than a 256-row piece), 1-2 s each
OVERHEAD_S = 0.15
COMPILE_S = 2.0
START_S = 12.0  # python + torch + CUDA context + triton import, before the first case


def plan_seconds(cases, n_impls: int) -> float:
    """Planned wall time of a GPU run from counts: start-up, the copy benchmark, per case and
    implementation the timed replays + overhead, and per case two Triton compilations."""
    return START_S + 1.0 + len(cases) * (n_impls * _per_impl_s() + 2 * COMPILE_S)


def _per_impl_s() -> float:
    return max(10 * GRAPH_REP_MS, WARMUP_MS + EVENT_REP_MS) / 1e3 + OVERHEAD_S


def case_bytes(tokens: int, hidden: int, kind: str) -> int:
    """Bytes one pooling call must move: bf16 hidden read once + fp32 chunk vectors written once."""
    lengths = chunk_lengths(tokens, kind, torch.Generator().manual_seed(0))
    return int(lengths.sum()) * hidden * 2 + len(lengths) * hidden * 4


def chunk_lengths(tokens: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """(n_chunks,) int64 chunk lengths of a case, summing to at most ``tokens`` (host tensor)."""
    if kind == "mixed":  # 1..512-token chunks: the DICE tail-heavy mix
        lengths = torch.randint(1, 513, (tokens // 256 + 1,), generator=g)
    elif kind == "long":
        lengths = torch.full((tokens // 8192 + 1,), 8192)
    elif kind.startswith("c"):
        n = int(kind[1:])
        lengths = torch.full((tokens // n + 1,), n)
    else:
        raise ValueError(f"unknown case kind {kind!r}")
    return lengths[torch.cumsum(lengths, 0) <= tokens]


def make_inputs(device: torch.device, tokens: int, hidden: int, kind: str, seed: int = 0):
    """(hidden (T, H) bf16, cu_seqlens int32, lengths int64), all on ``device``; the big tensor is
    drawn by the device's own generator."""
    lengths = chunk_lengths(tokens, kind, torch.Generator().manual_seed(seed))
    total = int(lengths.sum())
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    g = torch.Generator(device=device).manual_seed(seed)
    hidden_states = torch.randn(total, hidden, device=device, dtype=torch.bfloat16, generator=g)
    return hidden_states, cu.to(device), lengths.to(device)


class NoGraph(RuntimeError):
    """An implementation could not be captured in a CUDA graph."""


def timer(device: torch.device):
    """measure(fn, graph=True) -> (median s, p20 s, p80 s, how). On CUDA: graph replays, raising
    `NoGraph` when ``fn`` cannot be captured, or (graph=False) CUDA events; on the CPU wall clock."""
    if device.type == "cuda":
        import triton.testing

        def measure(fn, graph=True):
            if graph:
                try:
                    med = triton.testing.do_bench_cudagraph(fn, rep=GRAPH_REP_MS, return_mode="median")
                except Exception as exc:  # not capturable (a host sync, say)
                    torch.cuda.synchronize()
                    raise NoGraph(f"{type(exc).__name__}: {str(exc)[:120]}") from exc
                return med * 1e-3, float("nan"), float("nan"), "cudagraph"
            med, p20, p80 = triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=EVENT_REP_MS, quantiles=[0.5, 0.2, 0.8])
            return med * 1e-3, p20 * 1e-3, p80 * 1e-3, "events"

        return measure

    def measure(fn, graph=True, n=5):
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[len(ts) // 2], ts[0], ts[-1], "wall"

    return measure


def time_case(fns: dict, measure) -> dict:
    """{name: (median s, p20 s, p80 s, how)} of every implementation of one case, all with the same
    timer: graph replays when each can be captured, else events for all."""
    try:
        return {name: measure(fn, graph=True) for name, fn in fns.items()}
    except NoGraph as exc:
        print(f"    (no CUDA graph for every implementation: {exc}; timing all with events)", flush=True)
        return {name: measure(fn, graph=False) for name, fn in fns.items()}


def copy_bandwidth(device: torch.device, measure, nbytes: int) -> float:
    """GB/s of a device copy, counting bytes read + written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), graph=False)[0]
    return 2 * nbytes / t / 1e9


def composites(hidden, cu, lengths):
    n = len(lengths)
    seg = torch.repeat_interleave(torch.arange(n, device=hidden.device), lengths)
    idx = seg.unsqueeze(1).expand(-1, hidden.shape[1])
    counts = lengths.to(torch.float32).unsqueeze(1)

    def index_add():
        out = torch.zeros(n, hidden.shape[1], device=hidden.device)
        return out.index_add_(0, seg, hidden.float()) / counts

    def segment_reduce():
        return torch.segment_reduce(hidden.float(), "mean", lengths=lengths, unsafe=True)  # no host sync

    def scatter_reduce():
        out = torch.zeros(n, hidden.shape[1], device=hidden.device)
        return out.scatter_reduce_(0, idx, hidden.float(), "mean", include_self=False)

    return {"index_add": index_add, "segment_reduce": segment_reduce, "scatter_reduce": scatter_reduce}


def native_impl(device: torch.device, how: str) -> bool:
    """Whether the C++ twin can be timed: ``skip`` never; ``build`` builds it (or loads the cached build)."""
    if how == "skip":
        return False
    try:
        from dice_fast.ops import native

        native.build(with_cuda=device.type == "cuda")
        return True
    except Exception as exc:  # the twin is optional: say why it is missing and go on
        print(f"native extension not used: {exc}", file=sys.stderr, flush=True)
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", default="benchmarks/pooling.csv")
    ap.add_argument("--smoke", action="store_true", help="small sizes (CPU check of the script itself)")
    ap.add_argument("--native", choices=("build", "skip"), default="build",
                    help="time the C++ twin (build: build it or load its cached build; skip: leave it out)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip cases that would not fit in this many seconds")
    ap.add_argument("--plan", action="store_true", help="print the planned cases and time, and exit")
    args = ap.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else GPU_CASES
    if args.plan:
        n_impls = 3 + len(COMPOSITES)
        for c in cases:
            print(f"case {c}: {case_bytes(*c) / 1e9:.2f} GB per call")
        print(f"planned {plan_seconds(cases, n_impls):.0f} s for {len(cases)} cases x {n_impls} implementations")
        return 0
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    measure = timer(device)
    impls = {}
    if device.type == "cuda":
        impls["triton"] = "triton"
    if native_impl(device, args.native):
        impls["native"] = "native"
    impls["torch"] = "torch"
    bw = copy_bandwidth(device, measure, (1 << 24) if args.smoke else (1 << 30))
    print(f"copy bandwidth {bw:,.0f} GB/s on {device_name(device)}", flush=True)
    now, v = datetime.datetime.now().isoformat(timespec="seconds"), versions()
    per_case = _per_impl_s() * (len(impls) + len(COMPOSITES)) + (2 * COMPILE_S if "triton" in impls else 0)
    rows, skipped, bad = [], [], []
    print("| tokens | hidden | chunks | impl | timer | ms | GB/s | % of copy | max err |", flush=True)
    for tokens, hidden, kind in cases:
        if args.budget_s is not None and time.perf_counter() - t_start + per_case > args.budget_s:
            skipped.append((tokens, hidden, kind))
            continue
        h, cu, lengths = make_inputs(device, tokens, hidden, kind)
        nbytes = h.numel() * h.element_size() + len(lengths) * hidden * 4
        fns = {name: (lambda which=which: pool_chunks(h, cu, "mean", impl=which)) for name, which in impls.items()}
        fns.update(composites(h, cu, lengths))
        want = fns["index_add"]()
        errs = {name: float((fn() - want).abs().max()) for name, fn in fns.items()}
        case_rows = []
        for name, (t, p20, p80, how) in time_case(fns, measure).items():
            err = errs[name]
            r = dict(date=now, device=device_name(device), **v, impl=name, tokens=h.shape[0], hidden=hidden,
                     chunks=len(lengths), kind=kind, timer=how, ms=t * 1e3, p20_ms=p20 * 1e3, p80_ms=p80 * 1e3,
                     gbps=nbytes / t / 1e9, copy_gbps=bw, pct_of_copy=100 * nbytes / t / 1e9 / bw,
                     max_abs_err_vs_index_add=err)
            append_csv([r], args.csv)  # flushed on close: a later kill keeps this row
            print(f"| {r['tokens']} | {hidden} | {kind} {r['chunks']} | {name} | {how} | {r['ms']:.3f} | "
                  f"{r['gbps']:,.0f} | {r['pct_of_copy']:.0f}% | {err:.1e} |", flush=True)
            if not err <= 1e-3:
                bad.append(f"{name} {tokens}x{hidden} {kind}: max error {err:.3g}")
            case_rows.append(r)
        best = min(r["ms"] for r in case_rows if r["impl"] in COMPOSITES)
        for r in case_rows:
            if r["impl"] not in COMPOSITES:
                print(f"    {r['impl']}: {best / r['ms']:.2f}x the best PyTorch composite", flush=True)
        rows += case_rows
        del h, cu, lengths, fns, want
    print(f"{len(rows)} rows appended to {args.csv} in {time.perf_counter() - t_start:.0f} s", flush=True)
    if skipped:
        print(f"SKIPPED (budget {args.budget_s} s): {skipped}", flush=True)
    if bad:
        print("MISMATCH: " + "; ".join(bad), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
