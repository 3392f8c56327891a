"""dtype="int8": refused without int8 dot-product instructions, its quantized model cached under the
right key (another model or calibration never hits), and its agreement with float32 on held-out real
text above the bound docs/int8.md states."""

from __future__ import annotations

import copy

from pathlib import Path

import numpy as np
import pytest
import torch

from dice_fast import DiceConfig, DiceEncoder
from dice_fast.errors import InputError, OptionError
from dice_fast.quant import Int8Unsupported, agreement, check_int8_cpu, int8_dot_instructions
from dice_fast.quant import model_cache
from dice_fast.quant import openvino as ovq

from tiny_models import tiny

needs_int8 = pytest.mark.skipif(not int8_dot_instructions(), reason="this CPU has no VNNI / AMX int8 instructions")


def _need_backend():
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")


def test_refused_without_int8_instructions(monkeypatch):
    assert int8_dot_instructions({"avx2", "avx512_vnni", "amx_int8"}) == ("amx_int8", "avx512_vnni")
    monkeypatch.delenv("DICE_FAST_INT8_ANY_CPU", raising=False)
    with pytest.raises(Int8Unsupported, match="avx512_vnni"):
        check_int8_cpu({"avx2", "fma"})
    monkeypatch.setattr("dice_fast.cpu_tuning.cpu_flags", lambda: {"avx2"})
    model, tok, *_ = tiny("bert")
    with pytest.raises(Int8Unsupported, match="dtype='auto'.*runtime='openvino'"):
        DiceEncoder(model, tok, dtype="int8", chunk_size=16)
    monkeypatch.setenv("DICE_FAST_INT8_ANY_CPU", "1")
    with pytest.warns(UserWarning, match="anyway"):
        assert check_int8_cpu({"avx2"}) == ()


def test_calibration_option_belongs_to_int8():
    with pytest.raises(ValueError, match="dtype='int8' only"):
        DiceConfig(calibration="corpus.txt")
    with pytest.raises(ValueError, match="dtype must be one of"):
        DiceConfig(dtype="int4")
    assert DiceConfig(dtype="int8", calibration="corpus.txt").calibration == "corpus.txt"
    assert DiceConfig(dtype="int8", calibration=Path("corpus.txt")).calibration == "corpus.txt"  # os.PathLike
    with pytest.raises(ValueError, match="calibration must be a text file path"):
        DiceConfig(dtype="int8", calibration=3)


def test_too_little_calibration_text_is_refused_naming_its_source(tmp_path):
    """Two words set every activation range from four tokens (MiniLM: cos min 0.67 against float32):
    a calibration text shorter than MIN_CHUNKS chunks is refused, naming the file and how much it needs."""
    from dice_fast.quant import calibration as cal

    _, tok, *_ = tiny("bert")
    empty = np.zeros(0, np.int64)
    with pytest.raises(InputError, match=r"'hello.txt' gives \d+ tokens; int8 calibrates on at least 128"):
        cal.calibration_chunks(tok, "hello world", 16, empty, empty, 0, source="'hello.txt'")
    enough = "the cat sat on a mat and the dog ran to a big red house " * 12
    chunks = cal.calibration_chunks(tok, enough, 16, empty, empty, 0)
    assert len(chunks) >= cal.MIN_CHUNKS and all(ids.shape == (1, 16) for ids, _ in chunks)


def test_unreadable_calibration_file_is_named(tmp_path, monkeypatch):
    from dice_fast.quant import calibration as cal

    path = tmp_path / "corpus.txt"
    path.write_text("some text", encoding="utf-8")
    real_open = open

    def denied(file, *a, **k):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr("builtins.open", denied)
    with pytest.raises(InputError, match=r"cannot read .*corpus.txt.*Permission denied"):
        cal.calibration_text(path)  # a pathlib.Path too


def test_calibration_file_is_read_bounded_whole_characters_and_named_when_bad(tmp_path, monkeypatch):
    from dice_fast.quant import calibration as cal

    monkeypatch.setattr(cal, "MAX_BYTES", 16 * 7)  # 16 slices of 7 bytes: a slice edge inside most characters
    words = [f"{i:03d}é€😀" for i in range(200)]  # 1-, 2-, 3- and 4-byte characters
    big = tmp_path / "corpus.txt"
    big.write_text(" ".join(words), encoding="utf-8")
    text = cal.calibration_text(str(big))
    assert len(text.encode()) <= 16 * 7 + 15 * 2 and text.count("\n\n") == 15  # bounded, one piece per slice
    assert text.startswith("000é") and text.endswith("€😀")  # the slices span the file, first to last byte
    assert all(piece in " ".join(words) for piece in text.split("\n\n"))  # cut between characters only
    assert cal.calibration_text(str(big)) == text
    small = tmp_path / "small.txt"
    small.write_text("short é", encoding="utf-8")
    assert cal.calibration_text(str(small)) == "short é"  # a file within the bound is read whole
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf".encode() + "é".encode("latin-1") + b" " * 300)
    with pytest.raises(InputError, match=r"latin1.txt.*not UTF-8.*at byte 3"):
        cal.calibration_text(str(bad))
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n", encoding="utf-8")
    for path, what in ((blank, "holds no text"), (tmp_path, "is not a file"), (tmp_path / "missing.txt", "does not exist")):
        with pytest.raises(InputError, match=what):
            cal.calibration_text(str(path))
    with pytest.raises(FileNotFoundError, match="missing.txt"):  # a MissingFile, as every missing input is
        cal.calibration_text(str(tmp_path / "missing.txt"))


def test_cache_key_names_model_calibration_and_versions():
    calib = [(np.array([[1, 5, 2]]), np.array([[0, 1, 2]]))]
    other = [(np.array([[1, 6, 2]]), np.array([[0, 1, 2]]))]
    v = {"openvino": "1", "nncf": "2"}
    digest = ovq.calibration_hash(calib)
    assert digest != ovq.calibration_hash(other)
    keys = {ovq.cache_key("m", digest, v), ovq.cache_key("m2", digest, v),
            ovq.cache_key("m", ovq.calibration_hash(other), v), ovq.cache_key("m", digest, {**v, "openvino": "3"})}
    assert len(keys) == 4
    assert ovq.cache_key("m", digest, v) == ovq.cache_key("m", digest, dict(v))


@needs_int8
def test_quantized_model_cached_per_model_and_calibration(ov_cache, tmp_path, monkeypatch):
    _need_backend()
    model, tok, *_ = tiny("bert")
    texts = ["the cat sat on a mat and the dog ran to a big red house " * 3, "hello world"]
    sample, other = tmp_path / "corpus.txt", tmp_path / "other.txt"
    sample.write_text("the cat sat on a mat and the dog ran to a big red house " * 120, encoding="utf-8")
    other.write_text("the old man ran to the river under a blue sky " * 120, encoding="utf-8")
    int8 = {"dtype": "int8", "chunk_size": 16, "calibration": str(sample)}
    enc = DiceEncoder(model, tok, **int8)
    assert enc.precision.startswith("int8 (openvino") and "dtype=int8 (openvino" in repr(enc)
    first = enc.encode_documents(texts)
    assert len(model_cache.cached_models(ov_cache)) == 1
    with pytest.raises(OptionError, match="int8"):  # it pools whole rows: no chunk inside a window
        enc.plan(["a cat"], strategy="late")
    # a new process (empty memo) reads the model from disk: no export, same vectors
    monkeypatch.setattr(ovq, "_MEMO", {})
    real_export = ovq._export_and_quantize
    monkeypatch.setattr(ovq, "_export_and_quantize", lambda *a: pytest.fail("the disk cache was not used"))
    again = DiceEncoder(model, tok, **int8).encode_documents(texts)
    np.testing.assert_array_equal(first, again)
    monkeypatch.setattr(ovq, "_export_and_quantize", real_export)
    # another model (one weight changed) and another calibration each get a model of their own
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.embeddings.word_embeddings.weight[7, 0] += 1.0
    DiceEncoder(changed, tok, **int8)
    DiceEncoder(model, tok, **{**int8, "calibration": str(other)})
    assert len(model_cache.cached_models(ov_cache)) == 3
    # int8 vectors never share the float32 chunk cache's namespace
    assert DiceEncoder(model, tok, chunk_size=16).precision == "float32"


@needs_int8
def test_full_chunks_run_on_the_fixed_length_twin(ov_cache, tmp_path, monkeypatch):
    """Sub-batches as wide as a full chunk run on the twin compiled for that length, any other width on
    the dynamic model; a chunk's vector is the same (to the kernels' rounding) on either model."""
    _need_backend()
    model, tok, *_ = tiny("bert")
    sample = tmp_path / "corpus.txt"
    sample.write_text("the cat sat on a mat and the dog ran to a big red house " * 120, encoding="utf-8")
    enc = DiceEncoder(model, tok, dtype="int8", chunk_size=16, calibration=str(sample), max_batch_tokens=64)
    compiled = enc.runner.openvino
    assert compiled.width == 16 + enc.chunk_overhead and compiled.fixed is not None
    assert compiled.fixed.input("input_ids").get_partial_shape()[1].get_length() == compiled.width
    assert compiled.dynamic.input("input_ids").get_partial_shape()[1].is_dynamic
    used = []
    real_queue = type(enc.runner)._queue
    monkeypatch.setattr(type(enc.runner), "_queue", lambda self, model: used.append(model) or real_queue(self, model))
    texts = ["the old man ran to the river under a blue sky " * 6, "a short one", "the dog sat by the red house " * 2]
    out = enc.encode_documents(texts, return_chunks=True)
    assert "fixed" in used and {"dynamic", "latency"} & set(used)  # full chunks (several sub-batches), the tails
    # every chunk alone on the dynamic model only (no fixed width): the same chunk vectors
    monkeypatch.setattr(type(enc.runner), "_queue", real_queue)
    plain = DiceEncoder(model, tok, dtype="int8", chunk_size=16, calibration=str(sample))
    plain.runner.openvino = ovq.OpenVinoModel(compiled.dynamic, None, None, compiled.identity)
    alone = np.concatenate([plain.encode_documents([t], return_chunks=True).chunks for t in texts])
    cos = (alone * out.chunks).sum(1) / np.linalg.norm(alone, axis=1) / np.linalg.norm(out.chunks, axis=1)
    assert len(cos) >= 5 and cos.min() >= 1 - 1e-4, cos
    with pytest.raises(InputError, match="width"):
        ovq.int8_model(model, [(np.array([[1, 2]]), np.array([[0, 1]]))], ov_cache, "m", True, 1, width=0)


def test_recipe_is_part_of_the_cache_key(monkeypatch):
    """Another SmoothQuant alpha (or any recipe change) never reads a model quantized with the old one."""
    v = {"openvino": "1", "nncf": "2"}
    before, recipe = ovq.cache_key("m", "c", v), ovq.recipe_hash()
    monkeypatch.setitem(ovq.RECIPE, "smooth_quant_alpha", 0.95)
    assert ovq.cache_key("m", "c", v) != before and ovq.recipe_hash() != recipe


@needs_int8
def test_recipe_names_the_chunk_caches_namespace(ov_cache, tmp_path, monkeypatch):
    """The identity (the chunk cache's dtype entry) names the recipe: vectors of two recipes never mix."""
    _need_backend()
    model, tok, *_ = tiny("bert")
    sample = tmp_path / "corpus.txt"
    sample.write_text("the cat sat on a mat and the dog ran to a big red house " * 120, encoding="utf-8")
    opts = {"dtype": "int8", "chunk_size": 16, "calibration": str(sample)}
    shipped = DiceEncoder(model, tok, **opts).precision
    assert f"recipe {ovq.recipe_hash()[:8]}" in shipped
    monkeypatch.setitem(ovq.RECIPE, "smooth_quant_alpha", 0.95)
    assert DiceEncoder(model, tok, **opts).precision != shipped
    assert len(model_cache.cached_models(ov_cache)) == 2


class _FakeQueue:
    """Stands in for openvino.AsyncInferQueue: records starts and waits, runs callbacks at wait_all."""

    def __init__(self, model, jobs, events, fail):
        self.name, self.events, self.fail, self.pending = model.name, events, fail, []

    def set_callback(self, callback):
        self.callback = callback

    def start_async(self, feed, userdata, share_inputs=False):
        self.events.append(("start", self.name, feed["input_ids"].shape[1]))
        self.pending.append(userdata)

    def wait_all(self):
        self.events.append(("wait", self.name))
        for userdata in self.pending:
            out, lo, hi = userdata[:3]
            width = int(userdata[3].max())
            self.callback(_FakeRequest(hi - lo, width, out.shape[1], self.name in self.fail), userdata)
        self.pending = []


class _FakeRequest:
    def __init__(self, rows, width, hidden, fail):
        self.shape, self.fail = (rows, width, hidden), fail

    def get_output_tensor(self, index):
        if self.fail:
            raise RuntimeError("the fixed twin failed")
        return type("T", (), {"data": np.ones(self.shape, np.float32)})()


@needs_int8
def test_switching_models_waits_and_keeps_errors(ov_cache, tmp_path, monkeypatch):
    """A batch whose sub-batches change model waits for the first model's requests before starting the
    other's, pools every row, and raises an error of the first model's requests after the switch."""
    _need_backend()
    import openvino

    model, tok, *_ = tiny("bert")
    sample = tmp_path / "corpus.txt"
    sample.write_text("the cat sat on a mat and the dog ran to a big red house " * 120, encoding="utf-8")
    enc = DiceEncoder(model, tok, dtype="int8", chunk_size=16, calibration=str(sample), max_batch_tokens=64)
    width = enc.runner.openvino.width
    fixed, dynamic = (type("M", (), {"name": n})() for n in ("fixed", "dynamic"))
    enc.runner.openvino = ovq.OpenVinoModel(dynamic, fixed, width, enc.runner.openvino.identity)
    events, fail = [], set()
    monkeypatch.setattr(openvino, "AsyncInferQueue", lambda m, jobs: _FakeQueue(m, jobs, events, fail))
    texts = ["the old man ran to the river under a blue sky " * 6, "a short one"]
    out = enc.encode_documents(texts, return_chunks=True)
    assert np.all(out.chunks != 0) and np.all(out.chunks == out.chunks[0])  # every row pooled (all ones in)
    starts = [e for e in events if e[0] == "start"]
    assert {e[1] for e in starts} == {"fixed", "dynamic"}
    assert all((e[1] == "fixed") == (e[2] == width) for e in starts)
    switch = next(i for i, e in enumerate(events) if e[:2] == ("start", "dynamic"))
    assert ("wait", "fixed") in events[:switch]  # the twin's requests finished before the switch
    fail.add("fixed")
    with pytest.raises(RuntimeError, match="fixed twin failed"):
        enc.encode_documents(texts)


@needs_int8
@pytest.mark.timeout(300)
def test_int8_agrees_with_float32_on_held_out_prose(ov_cache, tmp_path):
    """The bundled all-MiniLM-L6-v2 at 128-token chunks, calibrated on a slice of the first half of the
    bundled prose, against float32 on 48 chunks of the held-out second half."""
    _need_backend()
    from dice_fast.data import prose_halves

    sample = tmp_path / "calibration.txt"
    sample.write_text("\n\n".join(prose_halves()[0][:40]), encoding="utf-8")
    fp32 = DiceEncoder.from_pretrained(device="cpu", chunk_size=126)
    int8 = DiceEncoder(fp32.model, fp32.tokenizer, dtype="int8", chunk_size=126, calibration=str(sample))
    a = agreement(int8, fp32, n_chunks=48)
    assert a.n_chunks == 48 and a.tokens == 48 * 126
    assert a.cos_min >= 0.98 and a.cos_mean >= 0.995, a
    # retrieval: passkey Hit@1 and evidence@1 of the DICE vector and MaxSim within 2 of 10 queries of float32
    from dice_fast.eval.run import build_task, run_eval

    task = build_task("passkey", fp32.tokenizer, [256, 1024], docs_per_length=5, queries_per_length=5)
    res = [run_eval(task, enc, chunk_sizes=(126,), aggregations=("mean",), scorings=("maxsim",), check_docs=0,
                    show_progress=False, log=None).metrics for enc in (fp32, int8)]
    for method in ("k126-mean", "k126-maxsim"):
        for metric in ("hit@1", "evidence@1"):
            want, got = (np.mean(list(r[method][metric].values())) for r in res)
            assert abs(got - want) <= 0.2 + 1e-9, (method, metric, want, got)
    # static scales: a chunk's vector does not depend on its batch neighbours or the padding
    texts = ["A short sentence about attributes.", "A longer paragraph " * 20]
    alone = np.concatenate([int8.encode_documents([t]) for t in texts])
    together = int8.encode_documents(texts)
    np.testing.assert_allclose((alone * together).sum(1), 1.0, atol=1e-4)


def test_openvino_requests_split_each_models_rows_evenly_across_the_streams():
    """Each model's rows (the fixed-length twin's, the others) in a multiple of the streams' count of requests
    of near-equal tokens, each within about REQUEST_TOKENS and REQUEST_SQUARE rows x width² (2 late windows
    of 512, 8 chunks of 256); consecutive, every row once, at least one each. Fewer rows than streams:
    as few requests as those bounds allow."""
    from dice_fast.quant.runner import REQUEST_SQUARE, request_groups

    lengths = np.array([600, 512, 512, 512, 383, 383, 383, 383, 256, 256, 256, 256, 256, 256, 256, 256, 256, 40, 3])
    groups = request_groups(lengths, 256, streams=2)
    assert [hi - lo for lo, hi, _ in groups] == [2, 2, 2, 2, 5, 4, 1, 1]
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths) and all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert all(len({lengths[lo] == 256, lengths[hi - 1] == 256}) == 1 for lo, hi, _ in groups)  # one model each
    assert not any(alone for _, _, alone in groups)  # every model has at least as many rows as streams
    assert [hi - lo for lo, hi, _ in request_groups(np.full(32, 256), 256, streams=2, square=REQUEST_SQUARE)] == [8] * 4
    assert [hi - lo for lo, hi, _ in request_groups(np.full(32, 256), 256, streams=2, square=2**40)] == [16, 16]
    assert request_groups(np.zeros(0, np.int64), 5, 2) == []
    # a model's rows fewer than the streams are alone (they run on the latency twin): cut only where a
    # request would be too big
    assert request_groups(np.array([5]), None, streams=4) == [(0, 1, True)]
    assert request_groups(np.array([5]), None, streams=1) == [(0, 1, False)]
    assert request_groups(np.array([256, 40, 3]), 256, streams=4) == [(0, 1, True), (1, 3, True)]
    assert request_groups(np.array([256, 256, 40]), 256, streams=2) == [(0, 1, False), (1, 2, False), (2, 3, True)]
    assert request_groups(np.array([3000, 3000, 3000]), None, streams=4) == [(0, 1, True), (1, 2, True), (2, 3, True)]


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_dense_pooling_matches_the_engines(pooling):
    """The int8 runner pools each dense sub-batch itself: the same vectors as the engine's pool_chunks
    on the valid tokens gathered into packing order (float32 rounding)."""
    from dice_fast.ops import pool_chunks
    from dice_fast.quant.runner import pool_dense

    rng = np.random.default_rng(0)
    lengths = np.array([7, 7, 5, 2, 1])
    hidden = rng.standard_normal((5, 7, 12)).astype(np.float32) * 10
    valid = np.arange(7)[None, :] < lengths[:, None]
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    want = pool_chunks(torch.from_numpy(hidden[valid]), cu, pooling, impl="reference").numpy()
    whole = (np.arange(5), np.zeros(5, np.int64), lengths)
    np.testing.assert_allclose(pool_dense(hidden, whole, pooling), want, rtol=1e-6, atol=1e-6)
    # segments inside rows (late chunking, a prompt left out): rows 0 and 2 from their third token
    segments = (np.array([0, 0, 2]), np.array([2, 5, 2]), np.array([3, 2, 3]))
    parts = [hidden[0, 2:5], hidden[0, 5:7], hidden[2, 2:5]]
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    want = pool_chunks(torch.from_numpy(np.concatenate(parts)), cu, pooling, impl="reference").numpy()
    np.testing.assert_allclose(pool_dense(hidden, segments, pooling), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="pooling"):
        pool_dense(hidden, whole, "max")


def test_agreement_of_no_texts_is_an_input_error():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=16)
    with pytest.raises(InputError, match="at least one text"):
        agreement(enc, enc, texts=[])


def test_exports_are_keyed_by_the_libraries_that_trace_them():
    """torch and transformers trace the exported graph: their minor versions key the int8 and float
    exports, as they key the chunk cache's namespace."""
    pytest.importorskip("openvino")
    assert {"openvino", "torch", "transformers"} <= set(ovq._float_versions())
    pytest.importorskip("nncf")
    assert {"openvino", "nncf", "torch", "transformers"} <= set(ovq._versions())
