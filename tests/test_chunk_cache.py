"""The persistent chunk cache: cached vectors equal computed ones, no other model or option ever hits,
damage is detected and recomputed, the size bound holds, and several processes share one cache."""

from __future__ import annotations

import copy
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dice_fast.reuse.persistent as cc
from dice_fast import DiceEncoder
from dice_fast.reuse.persistent import CACHE_FILE, CacheError, ChunkCache
from helpers import assert_close, kill_at_gate
from oracle import ATOL, K, corpus, text_of
from tiny_models import tiny

ROOT = Path(__file__).resolve().parents[1]


def _encoder(cache, model=None, **options):
    m, tok, *_ = tiny("bert")
    options = {"chunk_size": K, "max_batch_tokens": 40, "pooling_impl": "torch", **options}
    return DiceEncoder(model if model is not None else m, tok, cache=cache, **options)


def _runs(enc):
    seen = []
    real = enc.run_batch
    enc.run_batch = lambda packed: (seen.append(len(packed.chunk_ids)), real(packed))[1]
    return seen


@pytest.fixture(scope="module")
def texts():
    return corpus(seed=7, longest=6 * K)


@pytest.fixture(scope="module")
def want(texts):
    model, tok, *_ = tiny("bert")
    return DiceEncoder(model, tok, chunk_size=K, pooling_impl="torch").encode_documents(texts, return_chunks=True)


def test_cold_then_warm_equals_uncached_and_warm_runs_nothing(tmp_path, texts, want):
    enc = _encoder(tmp_path / "c")
    cold = enc.encode_documents(texts, return_chunks=True)
    assert enc.chunk_stats.written == enc.chunk_stats.computed > 0
    warm_enc = _encoder(ChunkCache(tmp_path / "c"))  # another encoder, the cache reopened
    seen, reported = _runs(warm_enc), []
    warm = warm_enc.encode_documents(texts, return_chunks=True, progress=lambda d, t: reported.append((d, t)))
    assert sum(seen) == 0 and warm_enc.chunk_stats.disk_hits == enc.chunk_stats.computed
    assert [sum(x) for x in zip(*reported)] == [len(texts), 0]  # every document reported, no token run
    for got, what in ((cold, "cold"), (warm, "warm")):
        assert_close(got.documents, want.documents, ATOL, what=f"{what} documents")
        assert_close(got.chunks, want.chunks, ATOL, what=f"{what} chunks")
    # queries share the cache under their own wrapping
    q = enc.encode_queries(texts[:4])
    assert_close(_encoder(tmp_path / "c").encode_queries(texts[:4]), q, ATOL, what="queries")


def test_no_other_model_or_option_ever_hits(tmp_path, texts):
    texts = texts[:3]
    cache = ChunkCache(tmp_path / "c")
    _encoder(cache).encode_documents(texts)
    model, *_ = tiny("bert")
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.encoder.layer[1].output.dense.bias[0] += 1e-3  # one weight differs
    variants = {
        "weights": dict(model=other),
        "dtype": dict(model=copy.deepcopy(model), dtype="bfloat16"),
        "pooling": dict(pooling="cls"),
        "prefix": dict(document_prefix="passage :"),
        "positions": dict(positions="global"),
        "attention": dict(attention="causal"),
    }
    for name, options in variants.items():
        enc = _encoder(cache, **options)
        enc.encode_documents(texts)
        assert enc.chunk_stats.disk_hits == 0 and enc.chunk_stats.computed > 0, name
    again = _encoder(cache)
    again.encode_documents(texts)
    assert again.chunk_stats.disk_misses == 0 and again.chunk_stats.computed == 0


def test_fingerprint_is_remembered_per_model_folder(tmp_path, monkeypatch):
    model, tok, *_ = tiny("bert")
    folder = tmp_path / "model"
    copy.deepcopy(model).save_pretrained(folder)  # saving sets config.architectures: not on the shared model
    tok.save_pretrained(folder)
    first = DiceEncoder.from_pretrained(folder, cache=tmp_path / "c", device="cpu", chunk_size=K)
    calls = []
    real = cc.model_fingerprint
    monkeypatch.setattr(cc, "model_fingerprint", lambda m: (calls.append(1), real(m))[1])
    second = DiceEncoder.from_pretrained(folder, cache=tmp_path / "c", device="cpu", chunk_size=K)
    assert calls == [] and second.cache.salt == first.cache.salt  # read from the cache, not rehashed
    weights = next(folder.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    DiceEncoder.from_pretrained(folder, cache=tmp_path / "c", device="cpu", chunk_size=K)
    assert calls == [1]  # a changed file is hashed again


@pytest.mark.parametrize("damage", ["flipped byte", "cut vector"])
def test_a_damaged_entry_is_recomputed_never_returned(tmp_path, texts, want, damage):
    enc = _encoder(tmp_path / "c")
    enc.encode_documents(texts)
    with sqlite3.connect(tmp_path / "c" / CACHE_FILE) as con:
        key, vec = con.execute("SELECT key, vec FROM chunks ORDER BY key LIMIT 1").fetchone()
        bad = vec[:5] + bytes([vec[5] ^ 1]) + vec[6:] if damage == "flipped byte" else vec[:-4]
        con.execute("UPDATE chunks SET vec=? WHERE key=?", (bad, key))
    again = _encoder(tmp_path / "c")
    got = again.encode_documents(texts, return_chunks=True)
    assert again.chunk_stats.damaged == 1 and again.chunk_stats.computed == 1
    assert_close(got.chunks, want.chunks, ATOL, what="after damage")
    third = _encoder(tmp_path / "c")
    third.encode_documents(texts)
    assert third.chunk_stats.damaged == 0 and third.chunk_stats.computed == 0  # repaired


def test_a_file_that_is_not_a_cache_is_refused(tmp_path):
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / CACHE_FILE).write_bytes(b"not a database at all " * 200)
    with pytest.raises(CacheError, match="garbage.*not a usable dice_fast chunk cache"):
        ChunkCache(tmp_path / "garbage")
    (tmp_path / "other").mkdir()
    with sqlite3.connect(tmp_path / "other" / CACHE_FILE) as con:
        con.execute("CREATE TABLE t(x)")
    with pytest.raises(CacheError, match="not a dice_fast chunk cache"):
        ChunkCache(tmp_path / "other")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheError, match="is a file"):
        ChunkCache(tmp_path / "file")


def test_a_truncated_database_is_detected_and_the_vectors_stay_right(tmp_path, want, texts):
    rng = __import__("random").Random(1)
    filler = [text_of(6 * K, rng) for _ in range(12)]
    enc = _encoder(tmp_path / "c")
    enc.encode_documents(filler + texts)
    enc.cache.cache.close()
    path = tmp_path / "c" / CACHE_FILE
    with sqlite3.connect(path) as con:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    os.truncate(path, path.stat().st_size // 2)
    try:
        again = _encoder(tmp_path / "c")
    except CacheError as exc:  # refused at open: also a clear answer
        assert str(path) in str(exc)
        return
    with pytest.warns(RuntimeWarning, match="damaged"):
        got = again.encode_documents(texts, return_chunks=True)
    assert_close(got.chunks, want.chunks, ATOL, what="truncated cache")


def test_the_size_bound_holds_and_least_recently_used_go_first(tmp_path):
    group = 300 * (48 + 128 + 4 * 64)  # bytes of 300 rows as stored_bytes counts them
    cache = ChunkCache(tmp_path / "c", max_gb=2.5 * group / 1e9)
    space = cache.bind({"test": 1}, 64)
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-2**62, 2**62, 1300))[:1200]
    keys = rng.permutation(keys).reshape(4, 300).tolist()  # scattered over the table, as hashes are
    groups = [(k, [x.to_bytes(8, "little", signed=True) * 16 for x in k], rng.standard_normal((300, 64)).astype(np.float32))
              for k in keys]
    for g in (0, 1):
        for lo in range(0, 300, 50):  # written in batches, as the queue does
            space.put(*(x[lo:lo + 50] for x in groups[g]))
    assert cache.stored_bytes() == 2 * group
    found, _ = space.get(*groups[0][:2])  # group 0 used again: group 1 is now the oldest
    assert len(found) == 300
    for lo in range(0, 300, 50):
        space.put(*(x[lo:lo + 50] for x in groups[2]))  # over the bound: evicts
    assert cache.stored_bytes() <= cache.max_bytes
    assert (tmp_path / "c" / CACHE_FILE).stat().st_size <= 1.5 * cache.max_bytes + 16 * 8192
    kept = [len(space.get(*groups[g][:2])[0]) for g in range(3)]
    assert kept[0] == 300 and kept[2] == 300 and kept[1] < 150, kept  # the least recently used went
    got, _ = space.get(*groups[2][:2])
    assert_close(np.stack([got[i] for i in range(300)]), groups[2][2], 0.0, what="stored vectors")


def _open_at(folder, barrier, errors):
    barrier.wait()
    try:
        ChunkCache(folder).close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        errors.put(f"{type(exc).__name__}: {exc}")


def test_processes_creating_one_cache_at_once_all_open_it(tmp_path):
    """Four processes open one new cache folder at the same moment, 25 times: each opens it. Before the folder
    guard, one saw the other's half-made database (header written, schema not committed) and refused it as
    not a chunk cache, or failed its switch to WAL with 'database is locked' (3 of 40 pairs); with the guard
    but before `is_cache` read again once the log was gone, one in about eight runs of this test refused a
    cache whose creator's close had checkpointed and deleted the log between is_cache's two reads."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    for round_ in range(25):
        barrier = ctx.Barrier(4)
        procs = [ctx.Process(target=_open_at, args=(tmp_path / f"c{round_}", barrier, errors)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert all(p.exitcode == 0 for p in procs)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found


_WRITER = r"""
import sys, time, numpy as np
sys.path.insert(0, {tests!r})
from pathlib import Path
from dice_fast import DiceEncoder
from oracle import corpus
from tiny_models import tiny
me, other = Path(sys.argv[1]), Path(sys.argv[2])
model, tok, *_ = tiny("bert")
enc = DiceEncoder(model, tok, chunk_size=8, max_batch_tokens=24, pooling_impl="torch", cache=sys.argv[3])
texts = corpus(seed=int(sys.argv[4]), longest=24)[:8] + corpus(seed=99, longest=24)[:8]
me.write_text("ready")
t0 = time.monotonic()
while not other.exists():  # a barrier: both processes write at once
    if time.monotonic() - t0 > 100: raise SystemExit("the other writer never came")
    time.sleep(0.01)
np.save(sys.argv[5], enc.encode_documents(texts))
print(enc.chunk_stats.written)
"""


def test_two_processes_write_one_cache_at_once(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(tests=str(ROOT / "tests")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / f"ready{i}"), str(tmp_path / f"ready{1 - i}"),
                               str(tmp_path / "c"), str(i), str(tmp_path / f"out{i}.npy")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outs = [p.communicate(timeout=110) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    model, tok, *_ = tiny("bert")
    plain = DiceEncoder(model, tok, chunk_size=8, pooling_impl="torch")
    union = []
    for i in range(2):
        texts = corpus(seed=i, longest=24)[:8] + corpus(seed=99, longest=24)[:8]
        union += texts
        assert_close(np.load(tmp_path / f"out{i}.npy"), plain.encode_documents(texts), ATOL, what=f"writer {i}")
    with sqlite3.connect(tmp_path / "c" / CACHE_FILE) as con:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    enc = DiceEncoder(model, tok, chunk_size=8, pooling_impl="torch", cache=tmp_path / "c")
    enc.encode_documents(union)
    assert enc.chunk_stats.computed == 0  # everything either process computed is there


_KILLED_WRITER = r"""
import sqlite3, sys, threading
from pathlib import Path
gate, out = Path(sys.argv[1]), Path(sys.argv[2])
real_connect = sqlite3.connect

def hook(sql):  # once a shard is committed: the next cache write is killed at its real COMMIT statement
    if sql == "COMMIT" and (out / "manifest.json").exists() and '"file"' in (out / "manifest.json").read_text():
        gate.write_text("committing")
        threading.Event().wait()

def connect(*args, **kwargs):
    con = real_connect(*args, **kwargs)
    con.set_trace_callback(hook)
    return con

sqlite3.connect = connect
from dice_fast.cli import main
sys.exit(main(sys.argv[3:]))
"""


def test_a_job_killed_mid_write_resumes_and_reruns_from_the_cache(tmp_path):
    import json

    from dice_fast.cli import main
    from dice_fast.corpus import load_embeddings

    model, tok, *_ = tiny("bert")
    folder = tmp_path / "model"
    copy.deepcopy(model).save_pretrained(folder)
    tok.save_pretrained(folder)
    rng = __import__("random").Random(3)
    docs = [text_of(rng.randint(5, 40), rng) for _ in range(40)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["encode", str(src), "-o", str(out), "-q", "--model", str(folder), "--chunk-size", str(K),
            "--max-batch-tokens", "24", "--shard-rows", "4", "--cache", str(cache)]
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_WRITER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    gate = tmp_path / "gate"
    kill_at_gate([sys.executable, str(script), str(gate), str(out), *args], gate, env, "a cache write")
    with sqlite3.connect(cache / CACHE_FILE) as con:  # the killed transaction is gone, the rest intact
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert con.execute("SELECT count(*) FROM chunks").fetchone()[0] > 0
        stored = int(con.execute("SELECT value FROM meta WHERE name='bytes'").fetchone()[0])
        assert stored == con.execute(f"SELECT sum({cc._ROW_BYTES} + length(ident) + length(vec)) FROM chunks").fetchone()[0]
    want = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=K).encode_documents(docs)
    assert main([*args, "--resume"]) == 0
    assert_close(load_embeddings(out)[1], want, ATOL, what="resumed")
    assert main([*args, "--overwrite"]) == 0  # the same job again with the same cache: nothing to compute
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    assert summary["chunks_computed"] == 0 and summary["chunks_from_cache"] > 0, summary
    assert_close(load_embeddings(out)[1], want, ATOL, what="re-run from the cache")


def test_a_late_chunks_identity_holds_its_windows_digest_not_the_window():
    """Each chunk's identity held its whole wrapped window: O(chunks x window) bytes (chunk_size 1,
    window 8191, 16k tokens: 506 MiB) in memory and in every cache row. Now 49 bytes each."""
    from dice_fast.reuse.keys import chunk_keys

    enc = DiceEncoder.from_pretrained(None, chunk_size=4, strategy="late", window_tokens=128)
    text = "the lighthouse keeper kept the brass key under the third stone " * 12
    plan = enc.plan([text, text, text + "and one more line"])
    keys = chunk_keys(plan, b"salt")
    idents = [keys.identity(c) for c in range(len(keys.keys))]
    assert {len(i) for i in idents} == {1 + 8 + 8 + 32} and all(i[:1] == b"D" for i in idents)
    doc = plan.chunks.document
    first, second, third = ([i for i, d in zip(idents, doc) if d == k] for k in range(3))
    assert first == second and len(set(first)) == len(first)  # same windows, same identities; no two alike
    assert third[0] == first[0] and third[-1] != first[-1]  # its first window is theirs, its last is not


def test_a_late_chunk_is_keyed_by_the_tokens_it_pools_not_by_its_text_offset(tmp_path):
    # A window with document_prefix "passage: " is token for token the window of an unprefixed encoder
    # given "passage: " + text; their chunks at the same text offset pool different tokens
    body = "the lighthouse keeper kept the brass key under the third stone by the door of the old tower"
    options = dict(chunk_size=8, strategy="late", window_tokens=64)
    DiceEncoder.from_pretrained(None, document_prefix="passage: ", cache=tmp_path / "c", **options
                                ).encode_documents([body])
    cached = DiceEncoder.from_pretrained(None, cache=tmp_path / "c", **options)
    got = cached.encode_documents(["passage: " + body], return_chunks=True)
    want = DiceEncoder.from_pretrained(None, **options).encode_documents(["passage: " + body], return_chunks=True)
    assert_close(got.chunks, want.chunks, 1e-5, what="late chunks served from a prefixed encoder's cache")
    assert cached.chunk_stats.disk_hits == 0


def test_precision_is_part_of_the_cache_namespace(tmp_path):
    """The namespace's "dtype" is what keeps an OpenVINO / int8 encoder's vectors (same torch weights,
    so the same model fingerprint) apart from the float32 torch encoder's; the openvino tests only compare
    `precision` strings, never the namespace, and are skipped without openvino."""
    from dice_fast import DiceEncoder
    from dice_fast.reuse.persistent import ChunkCache, settings_namespace

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=8, pooling_impl="torch")
    cache = ChunkCache(tmp_path / "c")
    torch_ns = settings_namespace(enc.settings, model, cache)
    ov_ns = settings_namespace(enc.settings, model, cache, precision="openvino-int8-abc")
    assert torch_ns.salt != ov_ns.salt and torch_ns.id != ov_ns.id
    assert settings_namespace(enc.settings, model, cache).salt == torch_ns.salt
