"""Issue 25's CPU measurements in one run, each with its target's verdict: what a session on a CPU kind
not measured yet (or measured before the latest kernels) runs, and pastes into benchmarks/RESULTS.md.

    bash benchmarks/peers_env.sh         # once per machine: the peers' own venv ($DICE_PEERS_VENV)
    python benchmarks/cpu_check.py       # 12 min on 2 quiet AMX Xeon cores, 25-28 on a Zen 2: run nothing else
    python benchmarks/cpu_check.py --verdict benchmarks/logs/cpu_check_20261205_0300   # re-read a run

Steps, each in its own process (no thread pool, OpenVINO or tuning state carries over):
1. the peer table: ``bench_peers.py --chunks 500 --repeats 5`` (sentence-transformers with PyTorch, ONNX
   Runtime and OpenVINO against dice_fast's float32, bf16, compiled and int8 paths; interleaved);
2. the mixed-length corpus: ``dice-fast bench --corpus mixed``, the engine in float32 against bf16;
   (float32 alone on a CPU without bf16 units, where the bf16 target does not apply);
3. ``dtype="auto"``: the path this machine picks (``print(encoder)``);
4. per-call latency: ``bench_latency.py`` (one text a call: queries, passages, chunks; the same paths).

The verdict (also in verdict.txt), against the targets the issue states for a Zen 4-like CPU:
* dice_fast's fastest path whose cos min is at least the fastest peer's: >= 1.2x that peer (medians;
  the per-round ratios beside it, as the rounds are interleaved);
* the engine's bf16 >= 1.7x its float32 on the mixed corpus;
* compiled float32 >= eager float32.
Beside them (no target stated): per size, dice_fast's fastest per-call path against the fastest peer's.
Everything goes under ``--out`` (default benchmarks/logs/cpu_check_<date>_<time>/): each step's log,
peers.csv, mixed.csv, latency.csv, verdict.txt. The machine and versions are in every CSV row.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from dice_fast.cpu_paths import HALF_UNITS, bf16_units  # noqa: E402 - which CPU flags run bf16 (else it is emulated)

TARGET_BEST = 1.2  # dice_fast's best path against the fastest peer, at cos min >= the peer's
TARGET_BF16_MIXED = 1.7  # bf16 against float32, the engine on the mixed corpus
TARGET_COMPILED = 1.0  # compiled float32 against eager float32


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="the run's folder (default: a new one in benchmarks/logs)")
    ap.add_argument("--chunks", type=int, default=500, help="bench_peers.py --chunks")
    ap.add_argument("--repeats", type=int, default=5, help="bench_peers.py --repeats")
    ap.add_argument("--verdict", type=Path, default=None, metavar="RUN",
                    help="measure nothing: print the verdict of the run folder RUN")
    return ap.parse_args(argv)


def read_rows(path: Path) -> list[dict]:
    """The rows of a CSV written by the benchmarks (empty when the file is missing)."""
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _each(row: dict) -> list[float]:
    return [float(x) for x in (row.get("tokens_per_s_each") or "").split("/") if x]


def verdict(peer_rows: list[dict], mixed_rows: list[dict]) -> list[str]:
    """Lines judging one run's rows against the issue's targets (``peer_rows``: bench_peers.py's CSV
    rows, ``mixed_rows``: ``dice-fast bench``'s); a target whose rows are missing says so."""
    lines = []
    peers = [r for r in peer_rows if r["path"].startswith("st_")]
    ours = [r for r in peer_rows if r["path"].startswith("dice_")]
    if peers and ours:
        peer = max(peers, key=lambda r: float(r["tokens_per_s"]))
        bound = float(peer["cos_min"])
        fit = [r for r in ours if float(r["cos_min"]) >= bound]
        if fit:
            best = max(fit, key=lambda r: float(r["tokens_per_s"]))
            ratio = float(best["tokens_per_s"]) / float(peer["tokens_per_s"])
            rounds = [a / b for a, b in zip(_each(best), _each(peer))]
            spread = f"; per round {min(rounds):.2f}-{max(rounds):.2f}x" if rounds else ""
            lines.append(f"best path {best['path']} {float(best['tokens_per_s']):,.0f} tokens/s (cos min "
                         f"{float(best['cos_min']):.5f}) against the fastest peer {peer['path']} "
                         f"{float(peer['tokens_per_s']):,.0f} (cos min {bound:.5f}): {ratio:.3f}x{spread}; "
                         f"target {TARGET_BEST}x: {'met' if ratio >= TARGET_BEST else 'NOT met'}")
        else:
            lines.append(f"best path: no dice_fast path reaches the fastest peer's cos min {bound:.5f}: NOT met")
        fastest = max(ours, key=lambda r: float(r["tokens_per_s"]))
        lines.append(f"dice_fast's fastest path at any agreement: {fastest['path']} "
                     f"{float(fastest['tokens_per_s']):,.0f} tokens/s, cos min {float(fastest['cos_min']):.5f}")
    else:
        lines.append("best path: no peer or no dice_fast rows (see the peers step's log)")
    by_path = {r["path"]: float(r["tokens_per_s"]) for r in ours}
    lines.append(_against("compiled float32 against eager", by_path, "dice_compiled", "dice_fp32", TARGET_COMPILED,
                          "the dice_fp32 or dice_compiled row is missing"))
    engine = {r["dtype"]: float(r["tokens_per_s"]) for r in mixed_rows if r.get("path") == "dice_fast"}
    isa = {f for r in peer_rows for f in (r.get("isa") or "").split(",") if f}  # the run's CPU, as bench_peers saw it
    if isa and not isa & set(HALF_UNITS["bfloat16"]) and "bfloat16" not in engine:
        lines.append(f"mixed corpus, bf16 against float32: does not apply: no bf16 units on this CPU (isa "
                     f"{','.join(sorted(isa))}), so bf16 was not run")
    else:
        lines.append(_against("mixed corpus, bf16 against float32", engine, "bfloat16", "float32", TARGET_BF16_MIXED,
                              "the engine's float32 or bf16 row is missing (see the mixed step's log)"))
    return lines


def latency_verdict(rows: list[dict]) -> list[str]:
    """Per size of bench_latency.py's ``rows``: dice_fast's fastest path whose cos min is at least the
    fastest peer's, against that peer (medians of per-call milliseconds; no target stated)."""
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        peers = [r for r in rows if r["size"] == size and r["path"].startswith("st_")]
        ours = [r for r in rows if r["size"] == size and r["path"].startswith("dice_")]
        if not peers or not ours:
            continue
        peer = min(peers, key=lambda r: float(r["median_ms"]))
        fit = [r for r in ours if float(r["cos_min"]) >= float(peer["cos_min"])]
        if not fit:
            lines.append(f"latency, {size}: no dice_fast path reaches {peer['path']}'s cos min {float(peer['cos_min']):.5f}")
            continue
        best = min(fit, key=lambda r: float(r["median_ms"]))
        lines.append(f"latency, {size} ({best.get('tokens', '?')} tokens): {best['path']} {float(best['median_ms']):.2f} ms against "
                     f"the fastest peer {peer['path']} {float(peer['median_ms']):.2f} ms: "
                     f"{float(peer['median_ms']) / float(best['median_ms']):.2f}x")
    return lines


def _against(what: str, rates: dict, fast: str, slow: str, target: float, missing: str) -> str:
    """One target's line: ``rates[fast] / rates[slow]`` (tokens/s) against ``target``; ``missing`` without both."""
    if fast not in rates or slow not in rates:
        return f"{what}: {missing}"
    ratio = rates[fast] / rates[slow]
    return (f"{what}: {rates[fast]:,.0f} against {rates[slow]:,.0f} tokens/s, {ratio:.3f}x; target {target}x: "
            f"{'met' if ratio >= target else 'NOT met'}")


def _step(name: str, cmd: list[str], out: Path) -> int:
    """Run one step, its output teed to out/<name>.log; its exit status."""
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    with open(out / f"{name}.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE.parent)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        return proc.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.verdict is not None:
        print("\n".join(verdict(read_rows(args.verdict / "peers.csv"), read_rows(args.verdict / "mixed.csv"))
                        + latency_verdict(read_rows(args.verdict / "latency.csv"))))
        return 0
    out = args.out or HERE / "logs" / f"cpu_check_{datetime.datetime.now():%Y%m%d_%H%M}"
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 1.0:
        print(f"warning: load average {load:.1f} before the run: is something else running?", flush=True)
    py = sys.executable
    # without bf16 units, bf16 matmuls are emulated (~6x slower than fp32, RESULTS §18.13): fp32 alone
    dtypes = ["float32"] + (["bfloat16"] if bf16_units() is None else [])
    status = {
        "peers": _step("peers", [py, str(HERE / "bench_peers.py"), "--chunks", str(args.chunks), "--repeats",
                                 str(args.repeats), "--csv", str(out / "peers.csv")], out),
        "mixed": _step("mixed", [py, "-m", "dice_fast.cli", "bench", "--corpus", "mixed", "--docs", "40", "--longest",
                                 "8192", "--dtypes", *dtypes, "--repeats", "3", "--no-sentence-transformers",
                                 "--budget-s", "90", "--csv", str(out / "mixed.csv")], out),
        "auto": _step("auto", [py, "-c", "from dice_fast import DiceEncoder; "
                               "print(DiceEncoder.from_pretrained(device='cpu', dtype='auto'))"], out),
        "latency": _step("latency", [py, str(HERE / "bench_latency.py"), "--csv", str(out / "latency.csv")], out),
    }
    lines = [f"{name} step: exit status {rc}" for name, rc in status.items() if rc]
    lines += verdict(read_rows(out / "peers.csv"), read_rows(out / "mixed.csv"))
    lines += latency_verdict(read_rows(out / "latency.csv"))
    (out / "verdict.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n== verdict (" + str(out / "verdict.txt") + ")\n" + "\n".join(lines))
    return max(status.values())


if __name__ == "__main__":
    sys.exit(main())
