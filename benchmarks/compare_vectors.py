"""Bit-for-bit proof that a change left every vector as it was: the same vectors at a reference commit
and at the working tree, on a fixed corpus with the bundled all-MiniLM-L6-v2.

    python benchmarks/compare_vectors.py --ref ed32828                 # vectors: documents, queries, chunks
    python benchmarks/compare_vectors.py --ref ed32828 --throughput 5  # and engine / padded ratios, 5 rounds
    python benchmarks/compare_vectors.py --ref ed32828 --throughput 3 --no-vectors

The reference is checked out in a temporary ``git worktree``; each side runs in its own subprocess with
``PYTHONPATH`` pointing at its tree. Each side encodes, in one process: documents (``encode_documents``,
dedup on and off), queries, ``return_chunks`` chunk vectors and spans, and the documents with a
persistent cache, cold and then warm (a fresh encoder on the same folder). The corpus holds duplicated
documents and a repeated passage so that dedup and the cache have work to do. Every array must be
equal bit for bit (``np.array_equal`` on the raw float32); the exit status is 1 otherwise.

``--throughput N``: N rounds, alternating the two trees in fresh subprocesses, each timing the engine's
batching of a tokenized corpus against the padded, length-sorted baseline of ``dice-fast bench``
and printing the engine / padded ratio; the medians per tree are compared (the ratio cancels most of
a shared machine's drift, the alternation the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

# runs inside each tree: writes the vectors to an .npz (argv[1]); argv[2]: a cache folder
VECTORS = r'''
import random, sys, warnings
import numpy as np
from dice_fast import DiceEncoder, DiceConfig

def corpus():
    rng = random.Random(7)
    words = open(__import__("dice_fast").__path__[0] + "/data/prose.txt", encoding="utf-8").read().split()
    docs = []
    for i in range(24):
        n = rng.choice([5, 40, 180, 400, 900])
        start = rng.randrange(len(words) - n)
        docs.append(" ".join(words[start:start + n]))
    passage = " ".join(words[100:400])
    docs += [docs[3], docs[11], passage + " " + docs[5], docs[7] + " " + passage, ""]  # copies, a shared passage
    return docs

def encoder(**options):
    if "dedup" in options and "dedup" not in DiceConfig.__dataclass_fields__:  # the reference commit
        dedup = options.pop("dedup")
        enc = DiceEncoder.from_pretrained(**options)
        enc._dedup = dedup
        return enc
    return DiceEncoder.from_pretrained(**options)

warnings.simplefilter("ignore")
docs = corpus()
queries = [d[:300] for d in docs[:12]] + ["what is a descriptor?", "x " * 400]
out = {}
enc = encoder(device="cpu", dtype="float32")
out["documents"] = enc.encode_documents(docs)
out["queries"] = enc.encode_queries(queries)
o = enc.encode_documents(docs, return_chunks=True)
out["chunks"], out["chunk_documents"] = o.chunks, o.documents
out["chunk_document"], out["chunk_start"], out["chunk_end"] = o.chunk_document, o.chunk_start, o.chunk_end
out["documents_nodedup"] = encoder(device="cpu", dtype="float32", dedup=False).encode_documents(docs)
for name, opts in (("weighted_trunc", dict(aggregation="weighted_mean", truncate_dim=128, chunk_size=64, overlap=8)),
                   ("global_max", dict(aggregation="max", positions="global", chunk_size=100,
                                       max_chunks_per_document=4))):
    e = encoder(device="cpu", dtype="float32", **opts)
    out[name] = e.encode_documents(docs)
    out[name + "_chunks"] = e.encode_documents(docs, return_chunks=True).chunks
for phase in ("cold", "warm"):
    e = encoder(device="cpu", dtype="float32", cache=sys.argv[2])
    out["cache_" + phase] = e.encode_documents(docs)
    out["cache_" + phase + "_chunks"] = e.encode_documents(docs, return_chunks=True).chunks
    out["cache_" + phase + "_stats"] = np.array([e.chunk_stats.disk_hits, e.chunk_stats.computed])
np.savez(sys.argv[1], **out)
'''

# runs inside each tree: prints {"engine": s, "padded": s, "ratio": engine / padded}
THROUGHPUT = r'''
import json, random, time, warnings
from dice_fast import DiceEncoder
from dice_fast.bench.run import encode_plan
from dice_fast.bench.baselines import encode_padded_sorted

class Planned:  # the encoder, its plan(texts) the plan made beforehand (as dice-fast bench gives the baselines)
    def __init__(self, encoder, plan):
        self.encoder, self.fixed = encoder, plan
    def plan(self, texts, kind="documents"):
        return self.fixed
    def __getattr__(self, name):
        return getattr(self.encoder, name)
warnings.simplefilter("ignore")
rng = random.Random(11)
words = open(__import__("dice_fast").__path__[0] + "/data/prose.txt", encoding="utf-8").read().split()
docs = []
for i in range(24):
    n = rng.choice([60, 300, 900, 2000])
    s = rng.randrange(len(words) - n)
    docs.append(" ".join(words[s:s + n]))
enc = DiceEncoder.from_pretrained(device="cpu", dtype="float32")
plan = enc.plan(docs)
encode_plan(enc, plan)  # warm-up
t = {}
planned = Planned(enc, plan)  # the baseline starts from the same tokenized corpus (as dice-fast bench)
for name, fn in (("engine", lambda: encode_plan(enc, plan)), ("padded", lambda: encode_padded_sorted(planned, docs))):
    best = []
    for _ in range(2):
        t0 = time.perf_counter(); fn(); best.append(time.perf_counter() - t0)
    t[name] = min(best)
t["ratio"] = t["padded"] / t["engine"]
print(json.dumps(t))
'''


def run_in(tree: Path, code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: failed:\n{done.stderr[-3000:]}")
    return done.stdout


def compare(ref: dict, head: dict) -> list[str]:
    bad = []
    for name in sorted(set(ref) | set(head)):
        if name not in ref or name not in head:
            bad.append(f"{name}: only in {'head' if name in head else 'ref'}")
            continue
        a, b = ref[name], head[name]
        same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        print(f"  {name:28s} {str(a.shape):14s} {a.dtype}  {'identical' if same else 'DIFFERENT'}")
        if not same:
            bad.append(name)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="the reference commit (e.g. the commit before the change)")
    ap.add_argument("--throughput", type=int, default=0, metavar="N",
                    help="also N alternating rounds of engine / padded throughput per tree (0: none)")
    ap.add_argument("--no-vectors", action="store_true", help="skip the vector comparison (throughput only)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dice_compare_") as tmp:
        tmp = Path(tmp)
        ref_tree = tmp / "ref"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(ref_tree), args.ref],
                       check=True)
        try:
            trees = {"ref": ref_tree, "head": ROOT}
            vectors, bad = {}, []
            for side, tree in (() if args.no_vectors else trees.items()):
                print(f"encoding at {side} ({tree}) ...", flush=True)
                run_in(tree, VECTORS, str(tmp / f"{side}.npz"), str(tmp / f"cache_{side}"))
                vectors[side] = dict(np.load(tmp / f"{side}.npz"))
            if vectors:
                print(f"vectors at {args.ref} (ref) vs the working tree (head):")
                bad = compare(vectors["ref"], vectors["head"])
                warm = vectors["head"]["cache_warm_stats"]
                print(f"  warm cache at head: {int(warm[0])} disk hits, {int(warm[1])} chunks computed")
            ratios = {"ref": [], "head": []}
            for r in range(args.throughput):
                for side in (("ref", "head") if r % 2 == 0 else ("head", "ref")):
                    t = json.loads(run_in(trees[side], THROUGHPUT).strip().splitlines()[-1])
                    ratios[side].append(t["ratio"])
                    print(f"  round {r} {side:4s}: engine {t['engine']:.3f} s, padded {t['padded']:.3f} s, "
                          f"padded / engine {t['ratio']:.3f}")
            if args.throughput:
                med = {s: statistics.median(v) for s, v in ratios.items()}
                print(f"median padded / engine: ref {med['ref']:.3f}, head {med['head']:.3f} "
                      f"(head / ref {med['head'] / med['ref']:.3f})")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(ref_tree)], check=False)
    if vectors:
        print("all identical" if not bad else f"DIFFERENT: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
