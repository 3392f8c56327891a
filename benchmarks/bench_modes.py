"""A/B of the engine's forward modes on one model and device, interleaved: eager against each mode.

    python benchmarks/bench_modes.py --modes graphs compiled producer [--random-model bert-base]
        [--dtype bfloat16] [--device cuda] [--budget-s 40] [--csv modes.csv]

* ``graphs``: small serving batches (16 and 64 queries, ~0.6k and ~2.4k tokens, planned beforehand:
  the model's work and the engine's batching, not the tokenizer) through CUDA graphs per token-count
  bucket (`dice_fast.graphs`) against the eager forward; on the CPU the padded path runs eagerly (a
  rehearsal of the script: the figure says nothing about graphs).
* ``compiled``: the mixed document corpus through the compiled forward (the encoder option named in
  `FEATURE_OPTIONS`) against eager.
* ``producer``: ``encode_documents`` end to end with the producer pipeline (``pipeline="on"``, the
  option in `FEATURE_OPTIONS`) against the serial loop (``pipeline="off"``: `BASELINE_OPTIONS`; the
  other modes' eager baseline keeps the default, on for CUDA).
* ``openvino`` (CPU): the mixed document corpus through OpenVINO's compiled graph (``runtime="openvino"``,
  float32 or bfloat16 by ``--dtype``) against PyTorch's eager forward, the engine's batching either way:
  ``python benchmarks/bench_modes.py --modes openvino --random-model bert-base --device cpu --dtype bfloat16``.
* ``late``: the mixed document corpus planned once per strategy and run by DICE ("eager" here: each chunk
  alone) against late chunking (``strategy="late"``, windows of ``--window-tokens``); tokens/s counts the
  documents' text tokens for both, so the ratio is the wall-time ratio. Their vectors differ by design:
  no cosine check (reported as nan). The quiet measurement: ``python benchmarks/bench_modes.py --modes late
  --random-model bert-base --docs 200 --longest 8192 --repeats 5 --budget-s 120 --csv benchmarks/modes.csv``.

A mode this tree lacks is reported ``SKIP <mode>: <why>`` and measured not at all; the exit status
is 3 when every requested mode was skipped (gpu_check.sh records the step as SKIP with that reason),
1 when a mode's vectors disagree with eager (min cosine < ``--min-cosine``), else 0. One row per
(mode, workload, variant) is appended to ``--csv`` as soon as the mode is measured: median, p20, p80
seconds, tokens/s, speed-up over eager, min cosine against eager's vectors.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dice_fast import DiceEncoder  # noqa: E402
from dice_fast.bench.corpora import RANDOM_MODELS, corpus_lengths, make_corpus, random_model  # noqa: E402
from dice_fast.bench.measure import run_paths  # noqa: E402
from dice_fast.bench.run import encode_plan  # noqa: E402
from dice_fast.config import DiceConfig  # noqa: E402
from dice_fast.cpu_paths import openvino_units  # noqa: E402
from dice_fast.runinfo import append_csv, device_name, versions  # noqa: E402

MODES = ("graphs", "compiled", "producer", "late", "openvino")
# the encoder option that switches a mode on, for the modes built in other issues: a tree whose
# DiceConfig has no such field SKIPs the mode ("compiled": the CPU issue's compiled forward)
FEATURE_OPTIONS = {"compiled": ("compile", "on"), "producer": ("pipeline", "on"), "late": ("strategy", "late"),
                   "openvino": ("runtime", "openvino")}
BASELINE_OPTIONS = {"producer": {"pipeline": "off"}}  # the eager variant of a mode, where not the default
# compile="on" traces the CUDA varlen backends too (issue 26): the GPU's compiled row runs
COMPILED_ON_CUDA = True
SKIPPED = 3


def feature_missing(mode: str, device: torch.device | None = None) -> str | None:
    """Why ``mode`` cannot run on this tree (or on ``device``), or None."""
    if mode == "graphs":
        try:
            import dice_fast.graphs  # noqa: F401
        except ImportError as e:
            return f"dice_fast.graphs is missing ({e})"
        return None
    name, _ = FEATURE_OPTIONS[mode]
    if name not in DiceConfig.field_names():
        return f"this tree's DiceConfig has no {name!r} option (the {mode} forward has not landed)"
    if mode == "openvino" and device is not None and device.type != "cpu":
        return f"runtime='openvino' runs on the CPU only, not {device}"
    if mode == "openvino" and (why := openvino_units()):
        return why
    if mode == "compiled" and not COMPILED_ON_CUDA:
        return "compile='on' compiles the CPU sdpa_groups forward only; the CUDA compiled forward has not landed"
    return None


def _queries(tok, n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return make_corpus(tok, rng.integers(8, 64, n), seed)


def workloads(mode: str, tok, docs: int, longest: int) -> dict:
    """{workload name: (kind, texts)} of ``mode``."""
    if mode == "graphs":
        return {"queries x16": ("queries", _queries(tok, 16, 1)), "queries x64": ("queries", _queries(tok, 64, 2))}
    return {"mixed documents": ("documents", make_corpus(tok, corpus_lengths("mixed", docs, 0, longest), 0))}


def variant_encoders(mode: str, model, tok, options: dict, args=None) -> dict:
    """{"eager": encoder, mode: encoder} on the same model."""
    eager = DiceEncoder(model, tok, **options, **BASELINE_OPTIONS.get(mode, {}))
    if mode == "graphs":
        from dice_fast.graphs import use_cuda_graphs

        other = DiceEncoder(model, tok, **options)
        use_cuda_graphs(other)
    else:
        name, value = FEATURE_OPTIONS[mode]
        extra = {"window_tokens": args.window_tokens} if mode == "late" and args.window_tokens else {}
        other = DiceEncoder(model, tok, **options, **{name: value}, **extra)
    return {"eager": eager, mode: other}


def measure_mode(mode: str, model, tok, options: dict, args, budget_s: float) -> list[dict]:
    encoders = variant_encoders(mode, model, tok, options, args)
    rows = []
    loads = workloads(mode, tok, args.docs, args.longest)
    for workload, (kind, texts) in loads.items():
        fns, tokens = {}, 0
        for variant, enc in encoders.items():
            if mode == "producer":  # end to end: the pipeline includes tokenizing and packing
                fns[variant] = lambda enc=enc: enc.encode_documents(texts)
                tokens = int(enc.plan(texts).tokens.lengths.sum())
            else:
                plan = enc.plan(texts, kind)
                tokens = int(plan.tokens.lengths.sum() if mode == "late" else plan.chunk_lengths.sum())
                fns[variant] = lambda enc=enc, plan=plan: encode_plan(enc, plan)
        res = run_paths(fns, args.repeats, encoders["eager"].device, budget_s=budget_s / len(loads))
        eager_med = float(np.median(res["eager"][0]))
        for variant, (times, peak, vecs) in res.items():
            med = float(np.median(times))
            rows.append(dict(
                date=datetime.datetime.now().isoformat(timespec="seconds"), device=device_name(encoders["eager"].device),
                **versions(), model=args.random_model, dtype=args.dtype, mode=mode, workload=workload, variant=variant,
                rounds=len(times), seconds_median=med, seconds_p20=float(np.percentile(times, 20)),
                seconds_p80=float(np.percentile(times, 80)), tokens_per_s=tokens / med, speedup_vs_eager=eager_med / med,
                min_cosine_vs_eager=(float("nan") if mode == "late" else
                                     float(np.min(np.sum(vecs * res["eager"][2], axis=1)))), peak_mem_mb=peak,
                backend=encoders[variant].backend))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--random-model", choices=sorted(RANDOM_MODELS), default="bert-base")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--layers", type=int, default=None, help="override the random model's depth (CPU rehearsals)")
    ap.add_argument("--hidden", type=int, default=None, help="override the random model's width (CPU rehearsals)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--docs", type=int, default=200, help="documents of the mixed corpus (compiled, producer)")
    ap.add_argument("--longest", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=40.0, help="timed seconds of all modes together, shared equally")
    ap.add_argument("--min-cosine", type=float, default=0.999)
    ap.add_argument("--window-tokens", type=int, default=None, help="late: window of late chunking (default: the "
                    "model's position table, at most 8192)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    missing = {m: why for m in args.modes if (why := feature_missing(m, device))}
    for m, why in missing.items():
        print(f"SKIP {m}: {why}", flush=True)
    todo = [m for m in args.modes if m not in missing]
    if not todo:
        return SKIPPED
    if args.layers or args.hidden:
        from agreement import widened_random_model

        model, tok = widened_random_model(args.random_model, 0.02, args.layers, args.hidden)
        model = model.to(device=device, dtype=getattr(torch, args.dtype))
    else:
        model, tok = random_model(args.random_model, device, getattr(torch, args.dtype))
    options = dict(device=str(device), dtype=args.dtype)
    bad = []
    for mode in todo:
        rows = measure_mode(mode, model, tok, options, args, args.budget_s / len(todo))
        if args.csv:
            append_csv(rows, args.csv)
        for r in rows:
            print(f"{r['mode']:9s} {r['workload']:16s} {r['variant']:9s} {r['seconds_median'] * 1e3:9.2f} ms "
                  f"{r['tokens_per_s']:12,.0f} tok/s  x{r['speedup_vs_eager']:.2f} vs eager  "
                  f"min cos {r['min_cosine_vs_eager']:.5f}  ({r['rounds']} rounds)", flush=True)
            if r["min_cosine_vs_eager"] < args.min_cosine:
                bad.append(f"{r['mode']} {r['workload']}: min cosine {r['min_cosine_vs_eager']:.5f} vs eager")
    for b in bad:
        print("FAIL:", b, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
