"""``dtype="auto"`` (`dice_fast.cpu_paths`): only paths that meet the agreement bound are chosen, the
choice is cached per machine and model, bf16 is a candidate only with bf16 units, and it is printed."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from dice_fast import DiceEncoder, cpu_paths
from dice_fast import cpu_attention, cpu_tuning
from tiny_models import tiny

REAL_FLAGS = cpu_tuning.cpu_flags()  # before the fixture replaces them
REAL_FIND_SPEC = importlib.util.find_spec


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("DICE_FAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_tuning, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    # OpenVINO's paths are candidates only in the tests that restore it (`_with_openvino`)
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "openvino" else REAL_FIND_SPEC(m, *a))
    cpu_attention.reset()
    yield
    cpu_attention.reset()


def _fake(rates, cos, busy=False, calls=None):
    def measure(encoders, reference):
        if calls is not None:
            calls.append(sorted(encoders))
        assert reference.dtype == torch.float32
        return {n: rates[n] for n in encoders}, {n: cos[n] for n in encoders}, busy
    return measure


def _bf16_fails(monkeypatch, exc: Exception):
    """Make every encoder built with dtype bfloat16 raise ``exc``; returns the real ``__init__``."""
    built = DiceEncoder.__init__

    def init(self, model, tok, config=None, **kw):
        if config is not None and config.dtype == "bfloat16":
            raise exc
        built(self, model, tok, config=config, **kw)

    monkeypatch.setattr(DiceEncoder, "__init__", init)
    return built


def _encoder(**options):
    model, tok, *_ = tiny("bert")  # tiny() is shared by the session: an encoder that picks bf16 moves its model
    return DiceEncoder(copy.deepcopy(model), tok, **{"chunk_size": 8, "pooling_impl": "torch", **options})


def test_fastest_path_within_the_bound_wins(monkeypatch):
    calls = []
    # bf16 is faster but disagrees: fp32 is chosen; then, cached, no measurement runs again
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": 300.0}, {"fp32": 1.0, "bf16": 0.99}, calls=calls))
    enc = _encoder(dtype="auto")
    assert enc.path_choice.name == "fp32" and enc.dtype == torch.float32 and enc.path_choice.source == "measured"
    assert calls == [["bf16", "fp32"]]
    again = _encoder(dtype="auto")
    assert again.path_choice.source == "cache" and again.path_choice.name == "fp32" and len(calls) == 1
    assert "path=fp32 (cache" in repr(again)


def test_faster_agreeing_path_is_chosen(monkeypatch):
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": 180.0}, {"fp32": 1.0, "bf16": 0.9995}))
    enc = _encoder(dtype="auto")
    assert enc.path_choice.name == "bf16" and enc.dtype == torch.bfloat16
    assert enc.config.dtype == "bfloat16" and enc.config.compile == "off"


def test_busy_measurement_is_not_cached(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 1.0, "bf16": 2.0}, {"fp32": 1.0, "bf16": 1.0}, busy=True, calls=calls))
    _encoder(dtype="auto")
    _encoder(dtype="auto")
    assert len(calls) == 2


@pytest.mark.parametrize("junk", ["list", "machine", "section", "slot", "values"])
def test_a_damaged_cache_file_costs_a_measurement_not_an_error(monkeypatch, junk):
    import json

    calls = []
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": 180.0}, {"fp32": 1.0, "bf16": 0.9995}, calls=calls))
    _encoder(dtype="auto")  # measured and cached
    path, key = cpu_tuning.cache_path(), cpu_tuning.machine_key()
    data = json.loads(path.read_text())
    slot = next(iter(data[key]["paths"]))
    damaged = {"list": [1, 2], "machine": {key: "x"}, "section": {key: {"paths": "x", "float32/d16": 5}},
               "slot": {key: {"paths": {slot: [1]}}},
               "values": {key: {"paths": {slot: {"tokens_per_s": {"fp32": "fast", "bf16": None},
                                                 "cos_min": {"fp32": "high", "bf16": True}}}}}}[junk]
    path.write_text(json.dumps(damaged))
    cpu_attention.reset()
    enc = _encoder(dtype="auto")
    assert enc.path_choice.name == "bf16" and enc.path_choice.source == "measured" and len(calls) == 2
    assert _encoder(dtype="auto").path_choice.source == "cache"  # and the repaired file is kept


def test_a_path_with_nan_vectors_is_never_chosen_and_measured_once(monkeypatch):
    calls = []
    nan = float("nan")
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": nan}, {"fp32": 1.0, "bf16": nan}, calls=calls))
    assert _encoder(dtype="auto").path_choice.name == "fp32"
    again = _encoder(dtype="auto").path_choice
    assert again.source == "cache" and again.cos_min["bf16"] == -1.0 and len(calls) == 1


def test_no_bf16_without_bf16_units(monkeypatch):
    monkeypatch.setattr(cpu_tuning, "cpu_flags", lambda: {"avx2"})
    calls = []
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 1.0, "bf16": 9.0}, {"fp32": 1.0, "bf16": 1.0}, calls=calls))
    assert _encoder(dtype="auto").path_choice.name == "fp32" and calls == [["fp32"]]


def test_candidates_follow_compile():
    names = lambda d, c: [p.name for p in cpu_paths.candidates(d, c)]  # noqa: E731
    assert names("auto", "off") == ["fp32", "bf16", "fp32+openvino", "bf16+openvino"]
    assert names("auto", "on") == ["fp32+compile", "bf16+compile"]
    assert names("bfloat16", "auto") == ["bf16", "bf16+compile", "bf16+openvino"]
    runtime = lambda r, b=cpu_paths.AGREEMENT: [p.name for p in cpu_paths.candidates("auto", "auto", b, runtime=r)]  # noqa: E731
    assert runtime("torch") == ["fp32", "bf16", "fp32+compile", "bf16+compile"]
    assert runtime("openvino") == ["fp32+openvino", "bf16+openvino"]
    assert runtime("openvino", 0.99) == ["fp32+openvino", "bf16+openvino", "int8"]
    extra = cpu_paths.CpuPath("int8-test", {"dtype": "float32", "compile": "off"})
    cpu_paths.register_path(extra)
    try:
        assert "int8-test" in names("auto", "off")
        # a path that names no runtime is PyTorch's (OpenVINO's only for int8)
        assert "int8-test" in [p.name for p in cpu_paths.candidates("auto", "off", runtime="torch")]
        assert "int8-test" not in [p.name for p in cpu_paths.candidates("auto", "off", runtime="openvino")]
    finally:
        cpu_paths.PATHS.remove(extra)


def test_real_measurement_agrees_with_itself():
    model, tok, *_ = tiny("bert")
    ref = DiceEncoder(model, tok, chunk_size=8, pooling_impl="torch")
    rates, cos, _ = cpu_paths.measure_paths({"fp32": ref}, ref)
    assert rates["fp32"] > 0 and cos["fp32"] == pytest.approx(1.0, abs=1e-6)


def test_real_measurement_under_late_chunking_times_windows(monkeypatch, ov_cache):
    """Under strategy="late" the paths are timed on late windows (OpenVINO ran 512-token windows of MiniLM
    at 0.75x PyTorch on the Zen 2, where it runs 256-token chunks faster), their chunks compared in order."""
    model, tok, *_ = tiny("bert")
    options = {"chunk_size": 8, "pooling_impl": "torch", "strategy": "late", "window_tokens": 40}
    ref = DiceEncoder(copy.deepcopy(model), tok, **options)
    paths = {"fp32": ref}
    if importlib.util.find_spec("openvino") is not None:
        paths["fp32+openvino"] = DiceEncoder(copy.deepcopy(model), tok, runtime="openvino", dtype="float32", **options)
    widths = []
    run_batch = DiceEncoder.run_batch
    monkeypatch.setattr(DiceEncoder, "run_batch", lambda self, b: widths.append(b.max_seqlen) or run_batch(self, b))
    rates, cos, _ = cpu_paths.measure_paths(paths, ref)
    assert max(widths) == 40 and all(r > 0 for r in rates.values())  # whole windows, 38 text tokens each
    assert all(c == pytest.approx(1.0, abs=1e-5) for c in cos.values()), cos


def test_auto_is_cpu_only():
    with pytest.raises(ValueError, match="CPU"):
        _encoder(dtype="auto", device="meta")


def test_lossy_paths_only_under_a_looser_bound():
    names = lambda d, c, b=cpu_paths.AGREEMENT: [p.name for p in cpu_paths.candidates(d, c, b)]  # noqa: E731
    assert "int8" not in names("auto", "auto")  # the default bound: int8 (cos min 0.994) is never measured
    assert names("auto", "off", 0.99) == ["fp32", "bf16", "fp32+openvino", "bf16+openvino", "int8"]
    assert names("bfloat16", "off", 0.99) == ["bf16", "bf16+openvino"] and names("auto", "on", 0.99) == ["fp32+compile", "bf16+compile"]


def test_int8_candidate_needs_int8_units_and_the_extra(monkeypatch):
    assert "VNNI" in cpu_paths.int8_units()  # the fixture's CPU: avx512_bf16 without VNNI
    monkeypatch.setattr(cpu_tuning, "cpu_flags", lambda: {"avx512f", "avx512_vnni"})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "nncf" else real(m, *a))
    assert "nncf not installed" in cpu_paths.int8_units()


def test_bound_option_checked():
    from dice_fast import DiceConfig

    for bad in (0.0, 1.5, True, "0.99"):
        with pytest.raises(ValueError, match="auto_agreement"):
            DiceConfig(auto_agreement=bad)
    assert DiceConfig().auto_agreement == cpu_paths.AGREEMENT == 0.999


def test_lossy_path_chosen_only_when_it_keeps_the_bound(monkeypatch):
    lossy = cpu_paths.CpuPath("lossy-test", {"dtype": "bfloat16", "compile": "off"}, lossy=True)
    cpu_paths.register_path(lossy)
    try:
        rates = {"fp32": 100.0, "bf16": 180.0, "lossy-test": 400.0}
        calls = []
        monkeypatch.setattr(cpu_paths, "measure_paths", _fake(rates, {"fp32": 1.0, "bf16": 0.9999, "lossy-test": 0.994},
                                                              calls=calls))
        assert _encoder(dtype="auto").path_choice.name == "bf16"  # default bound: not a candidate at all
        assert calls == [["bf16", "fp32"]]
        choice = _encoder(dtype="auto", auto_agreement=0.99).path_choice
        assert choice.name == "lossy-test" and calls[-1] == ["bf16", "fp32", "lossy-test"]
        assert "cos >= 0.99)" in str(choice)
        assert _encoder(dtype="auto", auto_agreement=0.995).path_choice.name == "bf16"  # measured 0.994 < 0.995
        assert len(calls) == 2  # the measurement is cached per candidate set, whatever the bound
    finally:
        cpu_paths.PATHS.remove(lossy)


def test_auto_picks_real_int8_when_fastest_within_the_bound(monkeypatch):
    from dice_fast.quant import int8_dot_instructions
    from dice_fast.quant import openvino as ovq

    if not int8_dot_instructions(REAL_FLAGS):
        pytest.skip("this CPU has no VNNI / AMX int8 instructions")
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    monkeypatch.setattr(ovq, "_MEMO", {})
    monkeypatch.setattr(cpu_tuning, "cpu_flags", lambda: REAL_FLAGS - {"avx512_bf16", "amx_bf16"})  # fp32, int8
    monkeypatch.setattr(importlib.util, "find_spec", REAL_FIND_SPEC)
    seen = {}

    def measure(encoders, reference):
        seen.update({n: e.precision for n, e in encoders.items()})
        rates = {"fp32": 100.0, "fp32+openvino": 120.0, "int8": 300.0}
        return rates, {"fp32": 1.0, "fp32+openvino": 1.0, "int8": 0.995}, False

    monkeypatch.setattr(cpu_paths, "measure_paths", measure)
    enc = _encoder(dtype="auto", auto_agreement=0.99)
    assert seen["int8"].startswith("int8 (openvino") and enc.path_choice.name == "int8"
    assert enc.precision.startswith("int8 (openvino") and "path=int8 (measured" in repr(enc)
    assert enc.encode_documents(["a short text to encode"]).shape == (1, enc.dim)


def test_auto_picks_openvino_bf16_when_fastest(monkeypatch):
    """With OpenVINO installed its float paths are measured beside PyTorch's against torch float32 eager
    (the reference, also under runtime="openvino"), and chosen when fastest within the bound."""
    pytest.importorskip("openvino")
    from dice_fast.quant import openvino as ovq

    monkeypatch.setattr(importlib.util, "find_spec", REAL_FIND_SPEC)
    monkeypatch.setattr(ovq, "_MEMO", {})
    if cpu_paths.bf16_units() is not None or not REAL_FLAGS & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("this CPU has no bf16 units: OpenVINO would run bf16 as f32")
    seen, refs = {}, []

    def measure(encoders, reference):
        seen.update({n: e.precision for n, e in encoders.items()})
        refs.append(reference.precision)
        rates = {"fp32": 100.0, "bf16": 150.0, "fp32+openvino": 120.0, "bf16+openvino": 210.0}
        return {n: rates[n] for n in encoders}, {n: 1.0 if "fp32" in n else 0.9999 for n in encoders}, False

    monkeypatch.setattr(cpu_paths, "measure_paths", measure)
    enc = _encoder(dtype="auto")
    assert sorted(seen) == ["bf16", "bf16+openvino", "fp32", "fp32+openvino"] and refs == ["float32"]
    assert seen["bf16+openvino"].startswith("bfloat16 (openvino") and enc.path_choice.name == "bf16+openvino"
    assert enc.config.runtime == "openvino" and enc.precision.startswith("bfloat16 (openvino")
    seen.clear()
    only = _encoder(dtype="auto", runtime="openvino")  # its own candidates; the reference is still torch's
    assert sorted(seen) == ["bf16+openvino", "fp32+openvino"] and refs == ["float32", "float32"]
    assert only.path_choice.name == "bf16+openvino"
    assert _encoder(dtype="auto", runtime="torch").path_choice.name == "bf16"


def test_no_candidate_names_the_options_and_each_reason():
    """runtime="openvino" without OpenVINO (the fixture hides it): the error names every option that
    selected the candidates and why each cannot run."""
    with pytest.raises(ValueError, match=r"runtime='openvino'.*fp32\+openvino: openvino not installed"):
        _encoder(dtype="auto", runtime="openvino")


def test_measurement_is_keyed_by_the_options_that_shape_the_forward(monkeypatch):
    """A measurement under one chunk size or pooling never decides for another (their cosines differ):
    each is measured; options that do not touch the measured forward (aggregation) reuse it."""
    calls = []
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": 180.0}, {"fp32": 1.0, "bf16": 0.9995}, calls=calls))
    _encoder(dtype="auto")
    assert _encoder(dtype="auto", aggregation="max").path_choice.source == "cache" and len(calls) == 1
    for options in ({"chunk_size": 6}, {"pooling": "cls"}, {"attention": "bidirectional"}):
        assert _encoder(dtype="auto", **options).path_choice.source == "measured"
    assert len(calls) == 4
    key = cpu_paths.options_key(_encoder(dtype="float32").config)
    assert key != cpu_paths.options_key(_encoder(dtype="float32", chunk_size=6).config)


def test_measurement_is_keyed_by_versions(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": 180.0}, {"fp32": 1.0, "bf16": 0.9995}, calls=calls))
    _encoder(dtype="auto")
    assert "transformers " in cpu_paths.versions() and f"paths {cpu_paths.PATHS_VERSION}" in cpu_paths.versions()
    monkeypatch.setattr(cpu_paths, "PATHS_VERSION", cpu_paths.PATHS_VERSION + 1)
    assert _encoder(dtype="auto").path_choice.source == "measured" and len(calls) == 2


def test_a_candidate_that_refuses_the_options_is_left_out(monkeypatch):
    """A path whose encoder refuses the other options (here bf16, as OpenVINO refuses an attention
    override or the compiled forward a padded-fallback model) is left out with its reason, and the
    decision (refusal included) is cached; the others are still measured and chosen from."""
    from dice_fast.errors import OptionError

    calls = []
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": 180.0}, {"fp32": 1.0, "bf16": 1.0}, calls=calls))
    real = cpu_paths.CpuPath
    refusing = real("bf16", {"dtype": "bfloat16", "compile": "off", "runtime": "torch"})
    monkeypatch.setattr(cpu_paths, "PATHS", [p if p.name != "bf16" else refusing for p in cpu_paths.PATHS])
    _bf16_fails(monkeypatch, OptionError("bf16 refuses these options (test)"))
    enc = _encoder(dtype="auto")
    assert enc.path_choice.name == "fp32" and calls == [["fp32"]]
    assert enc.path_choice.refused == {"bf16": "bf16 refuses these options (test)"}
    again = _encoder(dtype="auto")
    assert again.path_choice.source == "cache" and again.path_choice.refused and len(calls) == 1


def test_a_candidate_that_fails_to_build_is_left_out_and_not_cached(monkeypatch):
    """A failure that is not a refusal of the options (a broken C++ compiler under the compiled forward,
    a failed export) leaves that path out for this encoder instead of failing dtype="auto"; the
    measurement is not cached, so the path is tried again once the machine is fixed."""
    calls = []
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": 180.0}, {"fp32": 1.0, "bf16": 1.0},
                                                          calls=calls))
    built = _bf16_fails(monkeypatch, RuntimeError("the C++ compiler crashed (test)\nmore lines"))
    enc = _encoder(dtype="auto")
    assert enc.path_choice.name == "fp32" and calls == [["fp32"]]
    assert enc.path_choice.refused == {"bf16": "failed to build: RuntimeError: the C++ compiler crashed (test)\nmore lines"}
    monkeypatch.setattr(DiceEncoder, "__init__", built)
    again = _encoder(dtype="auto")  # measured again, the repaired path now among them
    assert again.path_choice.source == "measured" and again.path_choice.name == "bf16" and calls[-1] == ["bf16", "fp32"]


def test_a_measurement_under_a_kernel_override_is_kept_apart(monkeypatch):
    """An A/B run with a DICE_FAST_CPU_* override measures other kernels: its decision must not decide
    for the defaults (nor theirs for it)."""
    calls = []
    monkeypatch.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": 180.0}, {"fp32": 1.0, "bf16": 1.0},
                                                          calls=calls))
    monkeypatch.setenv("DICE_FAST_CPU_LINEAR", "torch")
    assert _encoder(dtype="auto").path_choice.source == "measured"
    monkeypatch.delenv("DICE_FAST_CPU_LINEAR")
    assert _encoder(dtype="auto").path_choice.source == "measured"
    assert _encoder(dtype="auto").path_choice.source == "cache" and len(calls) == 2


def test_auto_with_an_attention_override_leaves_openvino_out():
    """The reviewer's case: a decoder forced bidirectional with OpenVINO installed. OpenVINO's paths refuse
    the override; auto runs PyTorch's instead of failing on an option the user never set."""
    pytest.importorskip("openvino")
    import importlib.util as iu

    model, tok, *_ = tiny("qwen2")
    mp = pytest.MonkeyPatch()
    mp.setattr(iu, "find_spec", REAL_FIND_SPEC)
    mp.setattr(cpu_paths, "measure_paths", _fake({"fp32": 100.0, "bf16": 1.0, "fp32+openvino": 500.0},
                                                 {"fp32": 1.0, "bf16": 1.0, "fp32+openvino": 1.0}))
    try:
        enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=8, pooling_impl="torch", dtype="auto",
                          attention="bidirectional")
    finally:
        mp.undo()
    assert enc.path_choice.name == "fp32" and "fp32+openvino" in enc.path_choice.refused
    assert "attention" in enc.path_choice.refused["fp32+openvino"]


@pytest.mark.parametrize("dtype, units", [("bfloat16", {"avx512_bf16"}), ("float16", {"amx_fp16"})])
def test_half_precision_without_its_units_warns(monkeypatch, dtype, units):
    """An explicit bf16 / fp16 CPU forward where the CPU lacks dot products for it runs emulated matmuls
    (~6x / ~5x slower than float32 on the Zen 3): said at construction, naming the dtype and the remedy."""
    import warnings

    monkeypatch.setattr(cpu_tuning, "cpu_flags", lambda: {"avx2"})
    with pytest.warns(RuntimeWarning, match=f"dtype='{dtype}' on a CPU without .*dtype='float32'"):
        _encoder(dtype=dtype)
    monkeypatch.setattr(cpu_tuning, "cpu_flags", lambda: {"avx2"} | units)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _encoder(dtype=dtype)
        _encoder(dtype="float32")


def test_options_no_path_runs_together_are_named():
    """Options no path runs together (PyTorch's compiled forward on OpenVINO) name themselves, not the CPU."""
    from dice_fast.errors import OptionError

    with pytest.raises(OptionError, match=r"compile='on', runtime='openvino'.*none is a candidate of these options"):
        cpu_paths.choose_path(None, None, "auto", "on", runtime="openvino")
