"""runtime="openvino": float32 and bfloat16 on OpenVINO's fused CPU graph, behind the same plan, pack,
pool and aggregate. float32 is the per-chunk Hugging Face forward to float32 rounding on every
architecture; bf16 within bf16 rounding of it on the real model; a chunk's vector does not depend on
its batch (full chunks on the fixed-length twin, tails on the dynamic model); the export is cached per
model; every option it cannot take is refused naming the culprit."""

from __future__ import annotations

import copy
import ctypes
import importlib.util
import os
import time
import sys

from pathlib import Path

import numpy as np
import pytest
import torch

from dice_fast import DiceConfig, DiceEncoder, cpu_paths
from dice_fast.errors import InputError, MissingDependency, OptionError
from dice_fast.quant import agreement
from dice_fast.quant import model_cache
from dice_fast.quant import openvino as ovq

from oracle import K, check, corpus
from tiny_models import ARCHS, tiny

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None,
                                    reason="OpenVINO is not installed (the int8 extra)")
needs_bf16 = pytest.mark.skipif(cpu_paths.bf16_units() is not None, reason="this CPU has no bf16 units")


@needs_openvino
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_float32_matches_the_per_chunk_forward(arch, ov_cache):
    """Every chunk and document vector within 1e-5 of each chunk run alone through the plain Hugging
    Face forward (float64 aggregation): encoders and decoders, mean and last pooling, several batches."""
    enc, got = check(arch, runtime="openvino", dtype="float32")
    assert enc.precision.startswith("float32 (openvino") and "runs f32" in enc.precision
    assert len(model_cache.cached_models(ov_cache, "openvino")) == 1


@needs_openvino
def test_threads_calling_at_once_share_one_latency_twin_and_get_their_own_vectors(ov_cache):
    """Threads encoding single texts at once (a server's clients, an app's workers): the latency twin is
    compiled once, each thread has its own request queues, and every vector is the one of a call alone."""
    import threading

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, runtime="openvino", chunk_size=K, normalize=False)
    texts = [t[:60] for t in corpus(seed=5)][:8]
    want = [enc.encode_queries([t]) for t in texts]
    got, errors = {}, []

    def worker(i):
        try:
            for r in range(3):
                for j, t in enumerate(texts):
                    got[i, r, j] = enc.encode_queries([t])
        except Exception as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(got) == 4 * 3 * len(texts)
    for (_, _, j), vec in got.items():
        np.testing.assert_allclose(vec, want[j], atol=1e-6)
    twin = enc.runner.openvino.latency
    assert enc.runner.streams == 1 or (twin is not None and twin.get() is twin.get())


@needs_openvino
def test_a_query_never_waits_for_another_models_export(ov_cache):
    """The module's lock is held through a model's export (minutes for int8's calibration): a query on an
    encoder already loaded, whose latency twin compiles on its first use, runs meanwhile."""
    import threading

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, runtime="openvino", chunk_size=K, normalize=False)
    if enc.runner.openvino.latency is None:
        pytest.skip("one stream per process here: no latency twin")
    done = threading.Event()
    with ovq._LOCK:  # another thread's export in progress
        query = threading.Thread(target=lambda: (enc.encode_queries(["a cat"]), done.set()), daemon=True)
        query.start()
        assert done.wait(60), "the query waited for another model's export"
    query.join()


@needs_openvino
@pytest.mark.parametrize("arch", ["modernbert", "mistral-swa"])
def test_sliding_window_models_with_padded_rows_match_the_per_chunk_forward(arch, ov_cache):
    """A sliding-window model exported with its SDPA attention gave NaN for every row padded by more than
    its window (a padded position whose window holds no real key), and dtype='auto' chose it (measured on
    equal lengths only); the export now uses eager attention for such models, named in the identity."""
    enc, got = check(arch, chunk_size=24, max_batch_tokens=200, runtime="openvino", dtype="float32")
    assert np.isfinite(got.chunks).all() and "eager attention" in enc.precision


@needs_openvino
def test_chunk_vectors_do_not_depend_on_the_batch(ov_cache, monkeypatch):
    """Full chunks run on the twin compiled for their length, tails on the dynamic model, a model's rows
    fewer than the streams on the latency twin; a chunk's vector is the same alone, beside neighbours
    of other lengths, and on the dynamic model only."""
    model, tok, *_ = tiny("bert")
    budget = 40 * torch.get_num_threads()  # ~4 chunks per sub-batch (one stream per thread), whatever the cores
    enc = DiceEncoder(model, tok, runtime="openvino", chunk_size=K, max_batch_tokens=budget, normalize=False)
    assert enc.runner.openvino.width == K + enc.chunk_overhead and enc.max_batch_tokens // enc.runner.streams == 40
    used = []
    real_queue = type(enc.runner)._queue
    monkeypatch.setattr(type(enc.runner), "_queue", lambda self, model: used.append(model) or real_queue(self, model))
    texts = corpus(seed=3)
    together = enc.encode_documents(texts, return_chunks=True).chunks
    assert "fixed" in used and "dynamic" in used
    used.clear()
    alone = np.concatenate([enc.encode_documents([t], return_chunks=True).chunks for t in texts])
    np.testing.assert_allclose(alone, together, atol=1e-5)
    assert enc.runner.streams == 1 or "latency" in used  # a one-chunk text alone: one row
    dynamic_only = DiceEncoder(model, tok, runtime="openvino", chunk_size=K, max_batch_tokens=budget, normalize=False)
    compiled = dynamic_only.runner.openvino
    dynamic_only.runner.openvino = ovq.OpenVinoModel(compiled.dynamic, None, None, compiled.identity, compiled.runs)
    np.testing.assert_allclose(dynamic_only.encode_documents(texts, return_chunks=True).chunks, together, atol=1e-5)
    # queries run the same model (any length: the dynamic one)
    q = enc.encode_queries(["a cat", "the dog ran to the house"])
    want = DiceEncoder(model, tok, chunk_size=K, normalize=False).encode_queries(["a cat", "the dog ran to the house"])
    np.testing.assert_allclose(q, want, atol=1e-5)


@needs_openvino
def test_compiled_models_go_with_their_encoders_beyond_the_last_few(ov_cache, monkeypatch):
    """Every model compiled stayed in the process's memo (~80 MB each for a 4-layer model, one after
    another, in a review's soak): an entry lives while an encoder holds it or it is among the last
    `_KEEP` compiled (here one)."""
    import gc
    from collections import deque

    monkeypatch.setattr(ovq, "_RECENT", deque(maxlen=1))
    model, tok, *_ = tiny("bert")
    kept = DiceEncoder(model, tok, runtime="openvino", chunk_size=K)
    for i in range(2):  # the second evicts the first: the bound holds
        changed = copy.deepcopy(model)
        with torch.no_grad():
            changed.embeddings.word_embeddings.weight[7, 0] += 1.0 + i
        DiceEncoder(changed, tok, runtime="openvino", chunk_size=K).encode_documents(corpus(seed=4)[:2])
        del changed
        gc.collect()
        assert len(ovq._MEMO) == 2  # the kept encoder's and the last one compiled
    last = ovq._RECENT[0]
    DiceEncoder(model, tok, runtime="openvino", chunk_size=K)  # the kept encoder's, not compiled again
    assert len(ovq._MEMO) == 2 and ovq._RECENT[0] is last


@needs_openvino
def test_export_cached_per_model(ov_cache, monkeypatch):
    model, tok, *_ = tiny("bert")
    first = DiceEncoder(model, tok, runtime="openvino", chunk_size=K).encode_documents(corpus(seed=4))
    monkeypatch.setattr(ovq, "_MEMO", {})  # a new process: read from disk, no export
    real = ovq._export_float
    monkeypatch.setattr(ovq, "_export_float", lambda *a: pytest.fail("the disk cache was not used"))
    again = DiceEncoder(model, tok, runtime="openvino", chunk_size=K)
    np.testing.assert_array_equal(first, again.encode_documents(corpus(seed=4)))
    monkeypatch.setattr(ovq, "_export_float", real)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.embeddings.word_embeddings.weight[7, 0] += 1.0
    other = DiceEncoder(changed, tok, runtime="openvino", chunk_size=K)
    assert len(model_cache.cached_models(ov_cache, "openvino")) == 2 and other.precision != again.precision
    # OpenVINO's vectors never share the torch runtime's chunk-cache namespace
    assert DiceEncoder(model, tok, chunk_size=K).precision == "float32" != again.precision


@needs_openvino
def test_an_export_traces_once_without_torchscripts_check(ov_cache, monkeypatch):
    """``ov.convert_model`` traced with ``check_trace`` on: a second trace whose TorchScript state stays for
    the life of the process (~2.5 MB per transformer layer, every new model exported: RESULTS §28)."""
    calls = []
    real = torch.jit.trace

    def trace(*args, **kwargs):
        calls.append(kwargs.get("check_trace", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.jit, "trace", trace)
    monkeypatch.setattr(ovq, "_MEMO", {})  # exported here, not taken from an earlier test's
    check("bert", runtime="openvino", dtype="float32")  # the same graph: within 1e-5 of the per-chunk forward
    assert calls == [False]


@needs_openvino
@pytest.mark.parametrize("damage", ["truncated weights", "no graph"])
def test_a_damaged_cached_export_is_built_again(ov_cache, monkeypatch, damage):
    model, tok, *_ = tiny("bert")
    first = DiceEncoder(model, tok, runtime="openvino", chunk_size=K).encode_documents(corpus(seed=4))
    (key,) = model_cache.cached_models(ov_cache, "openvino")
    folder = ov_cache / "openvino" / key
    if damage == "no graph":
        (folder / "model.xml").unlink()
    else:
        with open(folder / "model.bin", "r+b") as fh:
            fh.truncate(1000)
    monkeypatch.setattr(ovq, "_MEMO", {})  # a new process
    with pytest.warns(UserWarning, match=f"cached OpenVINO model {folder} (does not match its checksum|holds no model.xml)"):
        again = DiceEncoder(model, tok, runtime="openvino", chunk_size=K)
    np.testing.assert_array_equal(first, again.encode_documents(corpus(seed=4)))
    assert sorted(p.name for p in folder.parent.iterdir()) == [key]  # rebuilt in place, nothing left aside


def _fake_model(folder: Path, xml: str) -> Path:
    """A cache entry as `_save` writes one (model.xml, model.bin, its checksum), for a fake OpenVINO core."""
    folder.mkdir(parents=True)
    (folder / "model.xml").write_text(xml)
    (folder / "model.bin").write_bytes(b"weights")
    (folder / model_cache.CHECKSUM).write_text(model_cache.checksum(folder))
    return folder


def test_a_model_rebuilt_by_another_process_meanwhile_is_read_not_discarded(tmp_path):
    """Two processes find the same damaged model: the one that reads after the other rebuilt it reads
    the new model (nothing discarded, nothing written); a model still damaged is set aside and written."""
    folder = _fake_model(tmp_path / "openvino" / "key", "damaged")
    written = []

    class Core:  # the first read fails; meanwhile "another process" puts a good model in place
        def read_model(self, path):
            if Path(path).read_text() == "damaged":
                new = _fake_model(folder.with_name("new"), "good")
                os.replace(folder, folder.with_name("old"))
                os.replace(new, folder)
                raise RuntimeError("Exception from src/x.cpp:1:\nbad xml")
            return Path(path).read_text()

    assert model_cache.read_or_write(Core(), folder, written.append) == "good" and written == []

    class Broken:
        def read_model(self, path):
            if not written:
                raise RuntimeError("Exception from src/x.cpp:1:\nbad xml")
            return "rebuilt"

    (folder / "model.xml").write_text("damaged")
    (folder / model_cache.CHECKSUM).write_text(model_cache.checksum(folder))

    def rebuild(out):
        written.append(out)
        out.mkdir()

    with pytest.warns(UserWarning, match="cannot be read \\(bad xml\\); it is built again"):
        assert model_cache.read_or_write(Broken(), folder, rebuild) == "rebuilt"
    assert written == [folder] and sorted(p.name for p in folder.parent.iterdir()) == ["key", "old"]


def test_a_model_changed_on_disk_is_rebuilt_not_run(tmp_path):
    """Bytes flipped in the weights (OpenVINO would read them and run: vectors moved by 0.03) fail the
    checksum; so does an entry without one (written before checksums). Both are set aside and rebuilt."""
    folder = _fake_model(tmp_path / "int8" / "key", "good")
    with open(folder / "model.bin", "r+b") as fh:
        fh.write(b"WEIGHTS")  # same size, other bytes
    built = []

    class Core:
        def read_model(self, path):
            return "read"

    def rebuild(out):
        built.append(out)
        _fake_model(out, "rebuilt")

    with pytest.warns(UserWarning, match="does not match its checksum"):
        assert model_cache.read_or_write(Core(), folder, rebuild) == "read" and built == [folder]
    (folder / model_cache.CHECKSUM).unlink()
    with pytest.warns(UserWarning, match="lacks model.sha256"):
        model_cache.read_or_write(Core(), folder, rebuild)
    assert len(built) == 2 and not [p for p in folder.parent.iterdir() if p.name.startswith(".")]


def test_a_checked_model_is_hashed_once_per_process_and_file(tmp_path, monkeypatch):
    """The checksum costs ~0.7 s per GB: a process checks a file version once (evaluation twins and
    dtype="auto"'s candidates read one export several times); a rewritten file is checked again."""
    folder = _fake_model(tmp_path / "openvino" / "key", "good")
    hashed = []
    real = model_cache.checksum
    monkeypatch.setattr(model_cache, "checksum", lambda f: hashed.append(f) or real(f))

    class Core:
        def read_model(self, path):
            return "read"

    for _ in range(3):
        assert model_cache.read_or_write(Core(), folder, lambda out: pytest.fail("rebuilt")) == "read"
    assert len(hashed) == 1
    (folder / "model.bin").write_bytes(b"other weights")
    with pytest.warns(UserWarning, match="does not match its checksum"):
        model_cache.read_or_write(Core(), folder, lambda out: _fake_model(out, "rebuilt"))


def test_an_entry_that_cannot_be_set_aside_is_named_and_nothing_is_left(tmp_path):
    """A regular file where the entry's folder should be, in a folder that refuses the move: the error
    names the entry (not the whole cache) and no empty ".discarded" folder is left behind."""
    entry = tmp_path / "int8" / "key"
    entry.parent.mkdir(parents=True)
    entry.write_text("not a folder")
    with pytest.raises(InputError, match=f"damaged OpenVINO cache entry {entry} cannot be replaced"):
        model_cache.read_or_write(object(), entry, lambda out: pytest.fail("written over a file"))
    assert sorted(p.name for p in entry.parent.iterdir()) == ["key"]


def test_stale_temporary_folders_are_not_listed_as_models(tmp_path):
    _fake_model(tmp_path / "int8" / "abc", "m")
    _fake_model(tmp_path / "int8" / ".abc.x1.tmp", "half-written")
    assert model_cache.cached_models(tmp_path) == ["abc"]


def test_a_killed_writers_leftovers_are_removed_when_the_entry_is_written(tmp_path):
    """A process killed while saving a model leaves ".KEY.*.tmp" (a model's size: gigabytes for a 7B
    int8 export); the next write of that entry removes it once its files are an hour old, and leaves
    a younger one (another process may be writing it now) and other entries' alone."""
    entry = tmp_path / "int8" / "key"
    old = _fake_model(entry.with_name(".key.a1b2c3d4.tmp"), "killed")
    young = _fake_model(entry.with_name(".key.e5f6a7b8.tmp"), "being written")
    other = _fake_model(entry.with_name(".other.a1b2c3d4.tmp"), "another key's")
    hour_ago = time.time() - model_cache.LEFTOVER_AGE_S - 60
    for p in (old, *old.iterdir(), other, *other.iterdir()):
        os.utime(p, (hour_ago, hour_ago))

    class Core:
        def read_model(self, path):
            return "read"

    assert model_cache.read_or_write(Core(), entry, lambda out: _fake_model(out, "new")) == "read"
    assert sorted(p.name for p in entry.parent.iterdir()) == sorted(["key", young.name, other.name])


def test_a_killed_writers_leftovers_are_removed_when_the_entry_is_read(tmp_path):
    """Two processes wrote one entry and one was killed: its ".KEY.*.tmp" stayed for good, since only a
    write of the entry removed leftovers, and the entry, the other's, was only read from then on."""
    entry = _fake_model(tmp_path / "openvino" / "key", "written by the survivor")
    killed = _fake_model(entry.with_name(".key.a1b2c3d4.tmp"), "killed")
    hour_ago = time.time() - model_cache.LEFTOVER_AGE_S - 60
    for p in (killed, *killed.iterdir()):
        os.utime(p, (hour_ago, hour_ago))

    class Core:
        def read_model(self, path):
            return Path(path).read_text()

    assert model_cache.read_or_write(Core(), entry, lambda out: pytest.fail("written again")) == "written by the survivor"
    assert sorted(p.name for p in entry.parent.iterdir()) == ["key"]


def test_writers_that_find_an_entry_missing_together_write_it_once(tmp_path):
    """N workers started at once (a process pool, Ray actors) each exported, or quantized for minutes, the
    same model: the first now writes it while the others wait, then read it. (flock excludes two opens in
    one process too, so threads stand in for the processes here.)"""
    import threading

    entry, written, got = tmp_path / "int8" / "key", [], []

    class Core:
        def read_model(self, path):
            return Path(path).read_text()

    def write(out):
        written.append(out)
        time.sleep(0.3)  # the export
        _fake_model(out, "the one export")

    workers = [threading.Thread(target=lambda: got.append(model_cache.read_or_write(Core(), entry, write)))
               for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert got == ["the one export"] * 3 and written == [entry]


def test_entries_unused_for_a_month_are_removed_when_another_is_written(tmp_path):
    """Keys hold the library versions, so an upgrade left every older export behind, a model's size
    each, forever: writing an entry removes those beside it not read for `UNUSED_DAYS`; a read marks
    its entry used, so one still in use (whenever written) stays."""
    root = tmp_path / "openvino"
    stale, read_lately, unmarked = (_fake_model(root / name, name) for name in ("stale", "read_lately", "unmarked"))
    month_ago = time.time() - (model_cache.UNUSED_DAYS + 1) * 86400
    for entry in (stale, read_lately, unmarked):
        for p in entry.iterdir():
            os.utime(p, (month_ago, month_ago))

    class Core:
        def read_model(self, path):
            return Path(path).read_text()

    assert model_cache.read_or_write(Core(), read_lately, lambda out: pytest.fail("rebuilt")) == "read_lately"
    (stale / model_cache.LAST_USED).touch()
    os.utime(stale / model_cache.LAST_USED, (month_ago, month_ago))
    assert model_cache.read_or_write(Core(), root / "new", lambda out: _fake_model(out, "new")) == "new"
    assert sorted(p.name for p in root.iterdir()) == ["new", "read_lately"]
    assert (root / "new" / model_cache.LAST_USED).is_file()


@needs_openvino
def test_a_full_disk_is_named(ov_cache, monkeypatch):
    """OpenVINO's save on a full disk raises "basic_ios::clear: iostream error": the error names the
    cache folder and the likely cause, and no half-written folder is left."""
    import openvino as ov

    def full(*a, **k):
        raise RuntimeError("Exception from src/core/src/pass/serialize.cpp:1:\nbasic_ios::clear: iostream error")

    monkeypatch.setattr(ov, "save_model", full)
    model, tok, *_ = tiny("bert")
    with pytest.raises(InputError, match=r"cannot write the OpenVINO model cache .*disk full"):
        DiceEncoder(model, tok, runtime="openvino", chunk_size=K)
    assert model_cache.cached_models(ov_cache, "openvino") == []
    assert not [p for p in (ov_cache / "openvino").iterdir() if p.name.endswith(".tmp")]


@needs_openvino
def test_a_cache_folder_that_cannot_be_written_is_named(ov_cache, monkeypatch):
    blocker = ov_cache / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DICE_FAST_CACHE_DIR", str(blocker))
    monkeypatch.setattr(ovq, "_export_float", lambda *a: pytest.fail("exported before the cache was checked"))
    model, tok, *_ = tiny("bert")
    with pytest.raises(ValueError, match=f"cannot write the OpenVINO model cache {blocker}.*DICE_FAST_CACHE_DIR"):
        DiceEncoder(model, tok, runtime="openvino", chunk_size=K)


def test_a_cache_entry_of_another_user_is_named(tmp_path, monkeypatch):
    """Entries are made 0700: in a cache folder shared between users, another user's entry raised a raw
    PermissionError from os.stat."""
    entry = tmp_path / "openvino" / "abc"
    real = os.stat

    def stat(path, *a, **k):
        if str(path).startswith(str(entry)):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(InputError, match=f"cannot read the OpenVINO model cache {entry} .*of your own"):
        model_cache.read_or_write(object(), entry, lambda out: pytest.fail("written"))


@needs_openvino
@needs_bf16
@pytest.mark.timeout(300)
def test_real_model_agreement_on_held_out_prose(ov_cache):
    """The bundled all-MiniLM-L6-v2 on 48 held-out prose chunks of 126 tokens against torch float32:
    OpenVINO float32 to float32 rounding, bf16 within bf16 rounding (the dtype="auto" bound, 0.999)."""
    fp32 = DiceEncoder.from_pretrained(device="cpu", chunk_size=126)
    ov32 = DiceEncoder(fp32.model, fp32.tokenizer, runtime="openvino", chunk_size=126)
    bf16 = DiceEncoder(copy.deepcopy(fp32.model), fp32.tokenizer, runtime="openvino", dtype="bfloat16", chunk_size=126)
    assert "runs bf16" in bf16.precision
    a32, a16 = agreement(ov32, fp32, n_chunks=48), agreement(bf16, fp32, n_chunks=48)
    assert a32.n_chunks == 48 and a32.cos_min >= 1 - 1e-6, a32
    assert a16.cos_min >= 0.9995 and a16.cos_mean >= 0.9999, a16


def test_options_it_cannot_take_are_refused(monkeypatch):
    with pytest.raises(OptionError, match="runtime"):
        DiceConfig(runtime="onnx")
    with pytest.raises(OptionError, match="runtime='torch' cannot run"):
        DiceConfig(dtype="int8", runtime="torch")
    with pytest.raises(OptionError, match="compile='on'"):
        DiceConfig(runtime="openvino", compile="on")
    with pytest.raises(OptionError, match="compile='on'"):
        DiceConfig(dtype="int8", compile="on")
    with pytest.raises(OptionError, match="compile='auto' chooses PyTorch's compiled forward; runtime='openvino'"):
        DiceConfig(runtime="openvino", dtype="bfloat16", compile="auto")
    assert DiceConfig(runtime="openvino", dtype="auto", compile="auto").openvino
    with pytest.raises(OptionError, match="not float16"):
        DiceConfig(runtime="openvino", dtype="float16")
    assert DiceConfig(dtype="int8").openvino == "dtype='int8'"
    assert DiceConfig(runtime="openvino").openvino == "runtime='openvino'"
    assert DiceConfig(dtype="bfloat16").openvino is None
    model, tok, *_ = tiny("bert")
    with pytest.raises(OptionError, match="attention_backend='sdpa_groups' cannot run with runtime='openvino'"):
        DiceEncoder(model, tok, runtime="openvino", chunk_size=K, attention_backend="sdpa_groups")
    decoder, dtok, *_ = tiny("llama")
    for culprit in ({"runtime": "openvino"}, {"dtype": "int8"}):  # the export keeps the model's own attention
        with pytest.raises(OptionError, match="attention='bidirectional' cannot run with"):
            DiceEncoder(decoder, dtok, chunk_size=K, pooling="mean", attention="bidirectional", **culprit)
    mine = copy.deepcopy(model)
    with pytest.raises(OptionError, match="runtime='openvino' runs on the CPU only; got device meta"):
        DiceEncoder(mine, tok, runtime="openvino", chunk_size=K, device="meta")
    assert next(mine.parameters()).device.type == "cpu"  # refused before the model moved (to a GPU: its memory)
    monkeypatch.setattr("dice_fast.cpu_tuning.cpu_flags", lambda: {"avx2"})
    with pytest.raises(OptionError, match="bf16 units"):
        DiceEncoder(copy.deepcopy(model), tok, runtime="openvino", dtype="bfloat16", chunk_size=K)


def test_missing_openvino_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino raises ImportError
    model, tok, *_ = tiny("bert")
    with pytest.raises(MissingDependency, match="runtime='openvino' needs OpenVINO"):
        DiceEncoder(model, tok, runtime="openvino", chunk_size=K)


@needs_openvino
def test_torchscript_turned_off_is_named_and_a_cached_export_still_runs(ov_cache, monkeypatch):
    """PYTORCH_JIT=0 turns TorchScript off, and with it the trace OpenVINO's export needs: runtime='openvino'
    died in OpenVINO's decoder ("Couldn't get TorchScript module by tracing ... no attribute
    'inlined_graph'"). Now it is refused naming the variable; a model exported before still runs (read
    from the cache, no trace), and dtype='auto' leaves the OpenVINO paths out."""
    import torch.jit._state

    model, tok, *_ = tiny("bert")
    exported = DiceEncoder(model, tok, runtime="openvino", chunk_size=K).encode_documents(corpus(seed=4)[:3])
    monkeypatch.setenv("PYTORCH_JIT", "0")
    monkeypatch.setattr(torch.jit._state._enabled, "enabled", False)  # what torch makes of it at import
    assert DiceEncoder(model, tok, runtime="openvino", chunk_size=K).encode_documents(corpus(seed=4)[:3]).tolist() \
        == exported.tolist()
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.embeddings.word_embeddings.weight[7, 0] += 1.0
    with pytest.raises(OptionError, match="TorchScript, which PYTORCH_JIT=0 turns off.*or use runtime='torch'"):
        DiceEncoder(changed, tok, runtime="openvino", chunk_size=K)
    assert "PYTORCH_JIT=0" in cpu_paths.openvino_units()
    assert all(p.usable() for p in cpu_paths.PATHS if p.options.get("runtime") == "openvino" or p.name == "int8")


@needs_openvino
def test_bf16_refused_where_openvino_would_run_f32(ov_cache, monkeypatch):
    """The last guard: OpenVINO silently runs f32 where a CPU lacks bf16; that is refused, not hidden."""
    model, tok, *_ = tiny("bert")
    real = ovq._load
    monkeypatch.setattr(ovq, "_load", lambda *a: (lambda m: ovq.OpenVinoModel(m.dynamic, m.fixed, m.width,
                                                                              m.identity, "f32"))(real(*a)))
    with pytest.raises(ValueError, match="as f32 on this CPU"):
        ovq.float_model(model, "bfloat16", ov_cache, "m", False, 1)
    with pytest.raises(ValueError, match="float32, bfloat16"):
        ovq.float_model(model, "float16", ov_cache, "m", False, 1)


@needs_openvino
@needs_bf16
def test_weights_stay_float32_and_one_export_serves_both_precisions(ov_cache):
    """OpenVINO rounds to its own precision from float32 weights (LayerNorm and biases stay float32 in
    its bf16), so bf16 and fp32 share one export; `from_pretrained` keeps them float32 on the CPU."""
    model, tok, *_ = tiny("bert")
    bf16 = DiceEncoder(copy.deepcopy(model), tok, runtime="openvino", dtype="bfloat16", chunk_size=K)
    fp32 = DiceEncoder(copy.deepcopy(model), tok, runtime="openvino", dtype="float32", chunk_size=K)
    assert bf16.dtype == torch.float32 and "runs bf16" in bf16.precision and "runs f32" in fp32.precision
    assert len(model_cache.cached_models(ov_cache, "openvino")) == 1 and bf16.precision != fp32.precision
    enc = DiceEncoder.from_pretrained(runtime="openvino", dtype="bfloat16")
    assert enc.device.type == "cpu" and next(enc.model.parameters()).dtype == torch.float32


class _SignalStack(ctypes.Structure):  # the C library's stack_t
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


def _signal_stack() -> tuple[int, bool]:
    """(address, mapped): this thread's alternate signal stack, and whether its memory is mapped."""
    stack = _SignalStack()
    ctypes.CDLL(None).sigaltstack(None, ctypes.byref(stack))
    sp = stack.ss_sp or 0
    spans = (line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines())
    return sp, sp == 0 or any(int(lo, 16) <= sp < int(hi, 16) for lo, hi in spans)


@needs_openvino
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the signal stack from /proc/self/maps")
def test_encoders_freed_oldest_first_leave_the_signal_stack_mapped(ov_cache, monkeypatch):
    """OpenVINO's CPU plugin (one per Core) gives the thread an alternate signal stack, and when destroyed
    restores the one it found and unmaps its own. With a Core per compiled model, two encoders freed
    oldest first left the thread on an unmapped stack: its next Ctrl-C or SIGTERM was a segmentation
    fault (a random test order found it: pytest itself died on the SIGTERM test)."""
    import gc
    from collections import deque

    monkeypatch.setattr(ovq, "_MEMO", {})
    monkeypatch.setattr(ovq, "_RECENT", deque(maxlen=0))  # the encoders hold the only references
    model, tok, *_ = tiny("bert")
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.embeddings.word_embeddings.weight[7, 0] += 1.0
    first = DiceEncoder(model, tok, runtime="openvino", chunk_size=K)
    second = DiceEncoder(changed, tok, runtime="openvino", chunk_size=K)
    ovq._MEMO.clear()
    del first
    gc.collect()
    del second
    gc.collect()
    sp, mapped = _signal_stack()
    if not mapped:  # no alternate stack rather than a dangling one, for the signals of the tests after this
        ctypes.CDLL(None).sigaltstack(ctypes.byref(_SignalStack(None, 2, 0)), None)  # 2: SS_DISABLE
    assert mapped, f"the thread's alternate signal stack {sp:#x} is unmapped: a signal would crash the process"
