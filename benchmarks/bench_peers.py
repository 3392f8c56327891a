"""dice_fast against the CPU peers a user would pick instead, on the same chunks of held-out prose.

    bash benchmarks/peers_env.sh                      # once: the peers' own venv (their pins conflict)
    python benchmarks/bench_peers.py                  # ~6-7 min on 2 quiet cores once exports are cached
    python benchmarks/bench_peers.py --chunks 1000 --repeats 3 --csv benchmarks/peers.csv

Rows: sentence-transformers with PyTorch fp32, ONNX Runtime fp32, ONNX Runtime dynamic int8
(avx512_vnni; and avx2 beside it on a CPU without VNNI), OpenVINO (default precision) and OpenVINO
static int8 (NNCF, calibrated on the first half of the bundled prose); dice_fast float32, bfloat16, compiled float32 and
bfloat16 (where the ``compile`` option exists), float32 and bfloat16 on OpenVINO (``runtime="openvino"``, where the option exists) and int8. Every path encodes the same ``--chunks`` texts of 254 tokens (256 with [CLS] and
[SEP]: one full window, one chunk each) cut from the held-out second half of the bundled prose. Runs
are interleaved (each repeat runs every path once, order rotated per repeat), seconds are medians
of ``--repeats``, after one warm-up call per path (64 texts). Agreement: cosine of every text's vector against
sentence-transformers' PyTorch fp32 one (min, mean).

The peers need transformers < 5 (optimum-onnx / optimum-intel pins) while dice_fast needs >= 5, so
they run in their own process and venv (benchmarks/peers_worker.py), which idles while dice_fast
runs and hands its vectors back as .npy files. Exports are made offline from the bundled model
folder and cached in --work.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
TEXT_TOKENS = 254  # + [CLS], [SEP] = the model's 256-token window
CALIBRATION_CHUNKS = 300
WARMUP_TEXTS = 64


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--chunks", type=int, default=500, help="texts of 254 tokens encoded by every path")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per path (median), interleaved")
    add_path_options(ap, HERE / "peers.csv")
    ap.add_argument("--int8-variants", nargs="*", default=[], metavar="STREAMS[@BUDGET][/PRECISION]",
                    help="extra dice_fast int8 rows for an A/B: e.g. 1 (one synchronous request, the first "
                    "version), 2@8192 (2 streams, max_batch_tokens 8192), 2/f32 (float parts in f32)")
    return ap.parse_args(argv)


def add_path_options(ap, csv_path: Path) -> None:
    """The options choosing and placing the paths (the peers' venv and exports, skips, the CSV)."""
    ap.add_argument("--venv", default=os.environ.get("DICE_PEERS_VENV", "/work/peers-venv"),
                    help="the peers' venv made by benchmarks/peers_env.sh ($DICE_PEERS_VENV)")
    ap.add_argument("--work", type=Path, default=None, help="exports and vectors (default: a temp folder per calibration)")
    ap.add_argument("--csv", type=Path, default=csv_path)
    ap.add_argument("--skip", nargs="*", default=[], help="path names not to run")
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    ap.add_argument("--no-peers", action="store_true",
                    help="dice_fast rows only (cosines against dice_fp32, or the first dice row when it is skipped)")


class Peers:
    """The peers' worker process (see benchmarks/peers_worker.py)."""

    def __init__(self, python: str, model_dir: str, work: Path, texts_file: Path, batch_size: int,
                 onnx_int8_configs: list[str]):
        self.work = work
        self.proc = subprocess.Popen(
            [python, str(HERE / "peers_worker.py"), "--model", model_dir, "--work", str(work), "--texts",
             str(texts_file), "--batch-size", str(batch_size), "--onnx-int8-configs", *onnx_int8_configs],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(work / "worker.log", "a"), text=True)
        self.ready = self._reply("ready")

    def _reply(self, event: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                msg = json.loads(line[3:])
                if msg["event"] == event:
                    return msg
                if msg["event"] == "error":
                    raise RuntimeError(f"peer worker: {msg}")
                print(f"  peers: {msg}", flush=True)
        raise RuntimeError(f"the peer worker exited (see {self.work / 'worker.log'})")

    def run(self, name: str, count: int | None = None) -> tuple[float, np.ndarray]:
        self.proc.stdin.write(name + ("" if count is None else f" {count}") + "\n")
        self.proc.stdin.flush()
        msg = self._reply("ran")
        return msg["seconds"], np.load(self.work / f"{name}.npy")

    def each(self, name: str, texts: list[str]) -> tuple[list[float], np.ndarray]:
        """``texts`` encoded by peer ``name`` one call each: (every call's seconds, (n, dim) vectors)."""
        file = self.work / "each.json"
        file.write_text(json.dumps(texts), encoding="utf-8")
        self.proc.stdin.write(f"each {name} {file}\n")
        self.proc.stdin.flush()
        return self._reply("ran")["seconds"], np.load(self.work / f"{name}.npy")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


def int8_variant(spec: str):
    """A dice_fast int8 encoder run as ``spec`` = STREAMS[@MAX_BATCH_TOKENS][/PRECISION] (see --int8-variants)."""
    from dice_fast import DiceEncoder
    from dice_fast.quant import openvino_runner

    rest, _, precision = spec.partition("/")
    streams, _, budget = rest.partition("@")
    enc = DiceEncoder.from_pretrained(device="cpu", dtype="int8", **({"max_batch_tokens": int(budget)} if budget else {}))
    hints = {"INFERENCE_PRECISION_HINT": precision} if precision else None
    enc.runner = openvino_runner(enc, enc.model, enc.tokenizer.pad_token_id, streams=int(streams), hints=hints)
    return enc


def dice_paths(skip, variants=()) -> tuple[dict, dict]:
    """(name -> DiceEncoder, name -> why skipped) for dice_fast's CPU paths (and int8 ``variants``)."""
    from dice_fast import DiceConfig, DiceEncoder
    from dice_fast.cpu_paths import bf16_units

    no_bf16 = bf16_units()  # None where the CPU has bf16 dot products
    wanted = {"dice_fp32": {"dtype": "float32"}, "dice_bf16": {"dtype": "bfloat16"},
              "dice_compiled": {"dtype": "float32", "compile": "on"},
              "dice_bf16_compiled": {"dtype": "bfloat16", "compile": "on"},
              "dice_ov_fp32": {"dtype": "float32", "runtime": "openvino"},
              "dice_ov_bf16": {"dtype": "bfloat16", "runtime": "openvino"}, "dice_int8": {"dtype": "int8"}}
    encoders, skipped = {}, {}
    for name, opts in wanted.items():
        if name in skip:
            continue
        if "bf16" in name and no_bf16 is not None:
            skipped[name] = "no avx512_bf16 / AMX: bf16 matmuls are emulated here (MiniLM ~6x slower than fp32, RESULTS §18.13)"
            continue
        if not set(opts) <= set(DiceConfig.field_names()):
            skipped[name] = f"this dice_fast has no {', '.join(sorted(set(opts) - set(DiceConfig.field_names())))} option"
            continue
        try:
            t0 = time.perf_counter()
            encoders[name] = DiceEncoder.from_pretrained(device="cpu", **opts)
            print(f"  {name}: built in {time.perf_counter() - t0:.1f} s: {encoders[name]!r}", flush=True)
        except Exception as exc:  # e.g. int8 without its extra or on a CPU without VNNI: say why
            skipped[name] = f"{type(exc).__name__}: {exc}"[:300]
    for spec in variants:
        name = f"dice_int8_s{spec}"
        t0 = time.perf_counter()
        encoders[name] = int8_variant(spec)
        print(f"  {name}: built in {time.perf_counter() - t0:.1f} s (streams {encoders[name].runner.streams})", flush=True)
    return encoders, skipped


def open_peers(args, model_dir: str, tok, texts: list[str]) -> tuple[Peers | None, dict, dict]:
    """(the peers' worker or None, peer -> why skipped, the peers' versions) for ``args.venv`` (None with
    ``args.no_peers``), exports cached in ``args.work`` (default: a temp folder per model and calibration)."""
    from dice_fast.cpu_tuning import cpu_flags
    from dice_fast.data import prose_halves, token_windows

    python = str(Path(args.venv) / "bin" / "python")
    if args.no_peers:
        return None, {"peers": "--no-peers"}, {}
    if not Path(python).exists():
        return None, {"peers": f"no peers venv at {args.venv}: run benchmarks/peers_env.sh"}, {}
    calibration = token_windows(tok, "\n\n".join(prose_halves()[0]), CALIBRATION_CHUNKS, TEXT_TOKENS)
    digest = hashlib.sha256(json.dumps([model_dir, calibration]).encode()).hexdigest()[:12]
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"dice_peers_{digest}"
    work.mkdir(parents=True, exist_ok=True)
    (work / "texts.json").write_text(json.dumps({"texts": texts, "calibration": calibration}), encoding="utf-8")
    print(f"peers' work folder {work}", flush=True)
    # sentence-transformers' avx512_vnni config everywhere (the faster one even on an AVX2-only Zen 3,
    # RESULTS §18.5), and beside it the avx2 config where there is no VNNI: the one a user is told to pick
    onnx_int8_configs = ["avx512_vnni"] + ([] if "avx512_vnni" in cpu_flags() else ["avx2"])
    peers = Peers(python, model_dir, work, work / "texts.json", args.batch_size, onnx_int8_configs)
    return peers, peers.ready["skipped"], peers.ready["versions"]


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from dice_fast.models import default_model_path
    from dice_fast.quant import cosines, held_out_texts
    from dice_fast.runinfo import cpu_model, versions
    from dice_fast.cpu_tuning import cpu_flags

    model_dir = default_model_path()
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = held_out_texts(tok, args.chunks, TEXT_TOKENS)
    tokens = sum(len(ids) for ids in tok(texts)["input_ids"])  # with [CLS] / [SEP]: what the model runs
    load0 = os.getloadavg()
    peers, peer_skipped, peer_versions = open_peers(args, model_dir, tok, texts)
    print(f"{len(texts)} texts, {tokens:,} tokens; load average {load0[0]:.1f}", flush=True)
    encoders, dice_skipped = dice_paths(args.skip, args.int8_variants)

    runs = {}
    for name in (peers.ready["peers"] if peers else []):
        if name not in args.skip:
            runs[name] = lambda count=None, name=name: peers.run(name, count)
    for name, enc in encoders.items():
        def dice_run(count=None, enc=enc):
            t0 = time.perf_counter()
            vecs = enc.encode_documents(texts[:count])
            return time.perf_counter() - t0, vecs
        runs[name] = dice_run
    # cosines against sentence-transformers fp32; without peers against dice_fp32 (else the first dice row)
    reference = "st_torch_fp32" if not args.no_peers else next((n for n in ("dice_fp32", *runs) if n in runs), "")
    if reference not in runs:
        raise SystemExit(f"the reference ({reference}) did not run: {peer_skipped} {dice_skipped}")

    seconds = {n: [] for n in runs}
    vectors = {}
    order = list(runs)
    for name in order:  # warm-up: first-call costs (OpenVINO compile, thread pools, tuning) paid here
        runs[name](WARMUP_TEXTS)
    for r in range(args.repeats):
        for name in order[r % len(order):] + order[: r % len(order)]:
            s, v = runs[name]()
            seconds[name].append(s)
            vectors[name] = v
            print(f"  repeat {r + 1}/{args.repeats} {name}: {s:.2f} s ({tokens / s:,.0f} tokens/s)", flush=True)
    peers and peers.close()
    load1 = os.getloadavg()

    ref = vectors[reference]
    base = tokens / float(np.median(seconds[reference]))
    flags = ",".join(sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                                                              "avx_vnni", "amx_bf16", "amx_int8")))
    when = datetime.datetime.now().isoformat(timespec="seconds")
    ours = versions()
    rows = []
    print(f"\n| path | tokens/s | x {reference} | cos min | cos mean |\n|---|---:|---:|---:|---:|")
    for name in order:
        tps = tokens / float(np.median(seconds[name]))
        cos = cosines(vectors[name], ref)
        print(f"| {name} | {tps:,.0f} | {tps / base:.2f} | {cos.min():.5f} | {cos.mean():.6f} |")
        rows.append({"date": when, "machine": f"{cpu_model()} ({os.cpu_count()} cores)", "isa": flags,
                     "path": name, "chunks": len(texts), "tokens": tokens, "repeats": args.repeats,
                     "seconds_median": float(np.median(seconds[name])), "tokens_per_s": tps,
                     "x_st_fp32": tps / base, "cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
                     "tokens_per_s_each": "/".join(f"{tokens / s:.0f}" for s in seconds[name]),  # per round
                     "load_start": round(load0[0], 2), "load_end": round(load1[0], 2),
                     "versions": json.dumps(peer_versions if name.startswith("st_") else ours, sort_keys=True)})
    write_rows(rows, args.csv, {**peer_skipped, **dice_skipped}, (load0[0], load1[0]), peer_versions)
    return 0


def write_rows(rows: list[dict], csv_path: Path, skipped: dict, loads: tuple, peer_versions: dict, cells: str = "") -> None:
    """The table's skipped paths (``cells``: the empty columns before the name), the loads and versions
    printed, then ``rows`` appended to ``csv_path``."""
    from dice_fast.runinfo import append_csv, versions

    for name, why in skipped.items():
        print(f"| {cells}{name} | skipped: {why} |")
    print(f"load average {loads[0]:.1f} at start, {loads[1]:.1f} at end; peers {peer_versions}; dice_fast {versions()}")
    append_csv(rows, csv_path)
    print(f"{len(rows)} rows appended to {csv_path}")


if __name__ == "__main__":
    sys.exit(main())
