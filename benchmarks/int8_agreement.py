"""int8 against float32 where it matters: chunk cosines on held-out prose and retrieval on the eval tasks.

    python benchmarks/int8_agreement.py                       # passkey + needle, 256..4096 tokens
    python benchmarks/int8_agreement.py --lengths 256,1024,4096,8192 --docs-per-length 20

Both encoders are the bundled all-MiniLM-L6-v2 with the same options; the int8 one is calibrated on
the first half of the bundled prose (or --calibration FILE). Printed: cos min / mean of chunk vectors
on --chunks windows of the held-out second half, then per task Hit@1 of the DICE document vector
(mean), MaxSim (best chunk) and the single-vector baseline, and evidence@1 (the best chunk holds the
answer) for DICE and MaxSim, each for float32, int8 and their difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", nargs="+", default=["passkey", "needle"])
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--docs-per-length", type=int, default=10)
    ap.add_argument("--queries-per-length", type=int, default=10)
    ap.add_argument("--chunk-size", type=int, default=254)
    ap.add_argument("--chunks", type=int, default=200, help="held-out prose windows for the cosines")
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--smooth-quant-alpha", type=float, default=None,
                    help="quantize with this SmoothQuant alpha instead of the recipe's (an A/B; its own cache key)")
    args = ap.parse_args(argv)

    from dice_fast import DiceEncoder
    from dice_fast.eval.run import build_task, method_key, run_eval
    from dice_fast.quant import agreement
    from dice_fast.quant import openvino as ovq

    if args.smooth_quant_alpha is not None:
        ovq.RECIPE["smooth_quant_alpha"] = args.smooth_quant_alpha

    fp32 = DiceEncoder.from_pretrained(device="cpu", chunk_size=args.chunk_size)
    t0 = time.perf_counter()
    int8 = DiceEncoder(fp32.model, fp32.tokenizer, dtype="int8", chunk_size=args.chunk_size,
                       calibration=args.calibration)
    print(f"int8 encoder ready in {time.perf_counter() - t0:.1f} s: {int8!r}")
    a = agreement(int8, fp32, n_chunks=args.chunks)
    print(f"held-out prose, {a.n_chunks} chunks of {args.chunk_size} tokens: cos min {a.cos_min:.5f}, "
          f"mean {a.cos_mean:.6f}")
    k = args.chunk_size
    rows = [("single", "hit@1"), (method_key(k, "mean"), "hit@1"), (method_key(k, "maxsim"), "hit@1"),
            (method_key(k, "mean"), "evidence@1"), (method_key(k, "maxsim"), "evidence@1")]
    lengths = [int(x) for x in args.lengths.split(",")]
    for spec in args.task:
        task = build_task(spec, fp32.tokenizer, lengths, args.docs_per_length, args.queries_per_length)
        res = {name: run_eval(task, enc, chunk_sizes=(k,), aggregations=("mean",), scorings=("maxsim",),
                              check_docs=0, show_progress=False, log=None)
               for name, enc in (("float32", fp32), ("int8", int8))}
        print(f"\n{spec} ({len(task.corpus)} documents, {len(task.queries)} queries, lengths {lengths}); "
              "macro average over lengths")
        print("| method | metric | float32 | int8 | int8 - float32 |\n|---|---|---:|---:|---:|")
        for method, metric in rows:
            vals = [float(np.mean(list(res[n].metrics[method][metric].values()))) for n in ("float32", "int8")]
            print(f"| {method} | {metric} | {vals[0]:.3f} | {vals[1]:.3f} | {vals[1] - vals[0]:+.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
