"""Query latency, memory per document and recall@10 of the dice_fast stores on synthetic DICE vectors.

    python benchmarks/bench_stores.py --docs 10000 100000 --queries 30 --out benchmarks/stores.json

Stores: ``DiceIndex`` exact (in memory), ``DiceIndex`` memory-mapped (saved, then loaded with
``mmap=True``), ``DiceIndex`` HNSW (``approximate=True``: faiss over the chunk vectors, candidates
re-scored exactly), Qdrant local mode (``QdrantClient(path=...)``), LanceDB flat and LanceDB IVF-PQ
(over the chunk multivector). Scoring: ``maxsim`` (the default) and ``dice``.

Vectors (no model): ``dim`` 384 like all-MiniLM-L6-v2, 1-8 chunks a document (mean 4.5, a ~1,100-token
document at chunk size 254), drawn around 512 topic centres so nearest neighbours mean something;
queries are a stored chunk plus noise. Latency: the median of single-query calls (after one warm-up);
recall@10: the share of the exact top 10 (`DiceIndex`) an approximate store returns. Memory per
document: bytes of vectors and spans held in RAM (`DiceIndex`: its arrays; HNSW: plus the graph), on
disk for the memory-mapped index, Qdrant's folder and LanceDB's table. Every step has a time budget
(``--budget``); a store whose build exceeds it at one size is not run at larger sizes (reported).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dice_fast import DiceIndex  # noqa: E402
from dice_fast.index import open_store  # noqa: E402

DIM = 384


def synthetic(n_docs: int, seed: int = 0):
    """(ids, documents, chunks, chunk_document, start, end, tokens) of ``n_docs`` synthetic documents."""
    rng = np.random.default_rng(seed)
    centres = _unit(rng.standard_normal((512, DIM)))
    counts = rng.integers(1, 9, n_docs)
    doc_of = np.repeat(np.arange(n_docs), counts)
    topic = rng.integers(0, len(centres), n_docs)
    chunks = _unit(centres[topic[doc_of]] + 0.9 * _unit(rng.standard_normal((len(doc_of), DIM))))
    sums = np.zeros((n_docs, DIM), np.float32)
    np.add.at(sums, doc_of, chunks)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    start = (np.arange(len(doc_of)) - first[doc_of]) * 1200
    return ([f"doc-{i}" for i in range(n_docs)], _unit(sums), chunks, doc_of, start, start + 1100,
            np.full(len(doc_of), 254))


def queries_for(chunks: np.ndarray, n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    picked = chunks[rng.integers(0, len(chunks), n)]
    return _unit(picked + 0.6 * _unit(rng.standard_normal((n, DIM))))


def _unit(x):
    x = np.asarray(x, np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def latency_ms(search, queries) -> float:
    search(queries[:1])
    times = []
    for i in range(len(queries)):
        t0 = time.perf_counter()
        search(queries[i : i + 1])
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def recall(got, exact) -> float:
    return float(np.mean([len({h.id for h in a} & {h.id for h in b}) / max(len(b), 1) for a, b in zip(got, exact)]))


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def run_size(n_docs: int, args, skip: set, root: Path) -> list[dict]:
    data = synthetic(n_docs)
    ids, documents, chunks, doc_of, start, end, tokens = data
    queries = queries_for(chunks, args.queries)
    rows = []

    def row(store, scoring, ms, per_doc, build_s, rec=None, note=""):
        rows.append({"docs": n_docs, "chunks": len(chunks), "store": store, "scoring": scoring, "latency_ms": round(ms, 2),
                     "bytes_per_doc": int(per_doc), "build_s": round(build_s, 1),
                     "recall@10": None if rec is None else round(rec, 3), "note": note})
        print(json.dumps(rows[-1]), flush=True)

    t0 = time.perf_counter()
    index = DiceIndex(DIM, store_text=False)
    index.add_arrays(*data)
    build = time.perf_counter() - t0
    exact = {s: index.search(queries, 10, s) for s in ("maxsim", "dice")}
    for s in ("maxsim", "dice"):
        row("DiceIndex exact", s, latency_ms(lambda q: index.search(q, 10, s), queries), index.nbytes / n_docs, build)

    folder = root / f"ix-{n_docs}"
    index.save(folder)
    mapped = DiceIndex.load(folder, mmap=True)
    for s in ("maxsim", "dice"):
        ms = latency_ms(lambda q: mapped.search(q, 10, s), queries)
        row("DiceIndex mmap", s, ms, disk_bytes(folder) / n_docs, 0, recall(mapped.search(queries, 10, s), exact[s]),
            "page cache warm")
    if "hnsw" not in skip:
        t0 = time.perf_counter()
        graph = index.build_graph("maxsim")
        build = time.perf_counter() - t0
        graph_bytes = len(__import__("faiss").serialize_index(graph))
        ms = latency_ms(lambda q: index.search(q, 10, "maxsim", approximate=True, candidates=100), queries)
        got = index.search(queries, 10, "maxsim", approximate=True, candidates=100)
        row("DiceIndex HNSW", "maxsim", ms, (index.nbytes + graph_bytes) / n_docs, build, recall(got, exact["maxsim"]),
            "faiss HNSW32 efSearch 128, candidates 100")
        if build > args.budget:
            skip.add("hnsw")

    for name, url, extra in (("Qdrant local", f"qdrant+path://{root}/q{n_docs}/docs", {}),
                             ("LanceDB", f"lancedb://{root}/l{n_docs}/docs", {})):
        key = name.split()[0].lower()
        if key in skip:
            continue
        t0 = time.perf_counter()
        store = open_store(url, dim=DIM, store_text=False, batch_size=1024, **extra)
        store.upsert_arrays(*data)
        build = time.perf_counter() - t0
        where = root / (f"q{n_docs}" if key == "qdrant" else f"l{n_docs}")
        for s in ("maxsim", "dice"):
            ms = latency_ms(lambda q: store.search(q, 10, s), queries[: max(5, len(queries) // (3 if key == "qdrant" else 1))])
            got = store.search(queries[:10], 10, s)
            row(f"{name}" + (" flat" if key == "lancedb" else ""), s, ms, disk_bytes(where) / n_docs, build,
                recall(got, exact[s][:10]), "exact" if key == "qdrant" else "no index: exact scan")
        if key == "lancedb" and "ivf" not in skip:
            t0 = time.perf_counter()
            store.build_index("chunks", num_partitions=max(8, int(np.sqrt(len(chunks)) / 4)), num_sub_vectors=48)
            ib = time.perf_counter() - t0
            for nprobes, refine, cand in ((20, None, 10), (20, 10, 10), (50, 10, 40)):
                store.search_options = {"nprobes": nprobes, **({"refine_factor": refine} if refine else {})}
                ms = latency_ms(lambda q: store.search(q, 10, "maxsim", candidates=cand), queries)
                got = store.search(queries, 10, "maxsim", candidates=cand)
                row("LanceDB IVF-PQ", "maxsim", ms, disk_bytes(where) / n_docs, ib, recall(got, exact["maxsim"]),
                    f"nprobes {nprobes}, refine_factor {refine}, candidates {cand}, 48 sub-vectors")
            if ib > args.budget:
                skip.add("ivf")
        if build > args.budget:
            skip.add(key)
        del store
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--queries", type=int, default=30)
    p.add_argument("--budget", type=float, default=300.0, help="seconds a store may take to build at one size")
    p.add_argument("--skip", nargs="*", default=[], help="stores not to run: hnsw qdrant lancedb ivf (LanceDB's IVF-PQ index)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    skip, rows = set(args.skip), []
    root = Path(tempfile.mkdtemp(prefix="bench-stores-"))
    try:
        for n in args.docs:
            rows += run_size(n, args, skip, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "skipped_at_largest": sorted(skip),
                                              "load": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
