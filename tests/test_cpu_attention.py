"""Hardware-aware CPU choices (`dice_fast.cpu_attention`): measured once per machine, cached, overridable,
never run at import, and exact whichever way they go."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from dice_fast import cpu_attention as tuning
from dice_fast import cpu_tuning
from helpers import assert_close


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """A cache folder of the test's own, no overrides from the caller's environment, quiet-machine
    load samples (so a measurement is cached whatever else runs on this machine)."""
    monkeypatch.setenv("DICE_FAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(tuning.ENV_DTYPE, raising=False)
    monkeypatch.delenv(tuning.ENV_KERNEL, raising=False)
    monkeypatch.setattr(cpu_tuning, "sample_others", lambda: None)
    tuning.reset()
    yield
    tuning.reset()


def _reference(q, k, v, causal, scale):
    """(n, Hq, L, D) float64 per-head attention, kv heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _qkv(n, hq, hkv, length, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # strided views of packed (tokens, heads, dim) projections, as the engine passes them
    return [torch.randn(n * length, h, d, generator=g).to(dtype).view(n, length, h, d).transpose(1, 2)
            for h in (hq, hkv, hkv)]


def test_nothing_runs_at_import(tmp_path):
    code = ("import dice_fast, dice_fast.cpu_attention, dice_fast.attention, pathlib, os\n"
            "assert not pathlib.Path(os.environ['DICE_FAST_CACHE_DIR']).exists()")
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ,
                                                                   "DICE_FAST_CACHE_DIR": str(tmp_path / "c")})


def test_measured_once_then_cached(monkeypatch):
    first = tuning.cpu_attention(torch.bfloat16, 32)
    assert first.source == "measured" and first.dtype in (torch.float32, torch.bfloat16)
    data = json.loads(cpu_tuning.cache_path().read_text())
    entry = data[cpu_tuning.machine_key()]["bfloat16/d32"]
    assert entry["dtype"] == str(first.dtype).replace("torch.", "") and "long_float32" in entry["ms"]
    tuning.reset()
    monkeypatch.setattr(tuning, "measure_cpu_attention", lambda *a, **k: pytest.fail("measured again"))
    again = tuning.cpu_attention(torch.bfloat16, 32)
    assert again.source == "cache" and again.dtype == first.dtype and again.matmul_max_len == first.matmul_max_len
    assert tuning.cpu_attention(torch.bfloat16, 32) is again  # the process's memo: no file read per layer


def test_cache_decides_and_is_per_machine(monkeypatch):
    path = cpu_tuning.cache_path()
    path.parent.mkdir(parents=True)
    entry = {"dtype": "bfloat16", "matmul_max_len": 64, "kernel": "sdpa", "ms": {}, "race": cpu_tuning.RACE_VERSION}
    older = dict(entry, race=cpu_tuning.RACE_VERSION - 1)  # timed by an older `race`: measured again
    path.write_text(json.dumps({cpu_tuning.machine_key(): {"bfloat16/d64": entry, "bfloat16/d32": older},
                                "another machine": {"bfloat16/d64": dict(entry, dtype="float32")}}))
    got = tuning.cpu_attention(torch.bfloat16, 64)
    assert (got.dtype, got.matmul_max_len, got.source) == (torch.bfloat16, 64, "cache")
    assert tuning.cpu_attention(torch.bfloat16, 32).source == "measured"
    assert "torch " + torch.__version__ in cpu_tuning.machine_key()


def test_busy_measurements_are_not_cached(monkeypatch):
    monkeypatch.setattr(cpu_tuning, "measured_load", lambda: 5.0)  # the entry is stamped there (decision_entry)
    assert tuning.cpu_attention(torch.bfloat16, 16).source == "measured"
    assert not cpu_tuning.cache_path().exists()


def test_environment_overrides(monkeypatch):
    monkeypatch.setattr(tuning, "measure_cpu_attention", lambda *a, **k: pytest.fail("measured despite the override"))
    monkeypatch.setenv(tuning.ENV_KERNEL, "sdpa")
    monkeypatch.setenv(tuning.ENV_DTYPE, "float32")
    assert tuning.cpu_attention(torch.bfloat16).dtype == torch.float32
    for alias in ("input", "bfloat16", "float16"):
        monkeypatch.setenv(tuning.ENV_DTYPE, alias)
        assert tuning.cpu_attention(torch.bfloat16).dtype == torch.bfloat16
        assert tuning.cpu_attention(torch.float16).dtype == torch.float16
    assert tuning.cpu_attention(torch.float32).dtype == torch.float32  # never below the input's precision
    monkeypatch.setenv(tuning.ENV_DTYPE, "fp8")
    with pytest.raises(ValueError, match="DICE_FAST_CPU_ATTENTION_DTYPE"):
        tuning.cpu_attention(torch.bfloat16)
    with pytest.raises(ValueError, match="DICE_FAST_CPU_ATTENTION_DTYPE"):  # refused for float32 inputs too
        tuning.cpu_attention(torch.float32)
    monkeypatch.setenv(tuning.ENV_DTYPE, "auto")
    monkeypatch.setenv(tuning.ENV_KERNEL, "flash")
    with pytest.raises(ValueError, match="DICE_FAST_CPU_ATTENTION_KERNEL"):
        tuning.cpu_attention(torch.bfloat16)


def test_a_measurement_under_a_kernel_override_never_decides_for_auto(monkeypatch):
    """A run with DICE_FAST_CPU_ATTENTION_KERNEL=sdpa measures without the AMX kernel; it used to store
    that under the auto decision's name, switching the AMX kernel off for good on that machine."""
    monkeypatch.setattr(tuning, "amx_kernel", lambda: (True, ""))  # as on an AMX Xeon, with its timings
    times = {"long_float32": 10.0, "long_bfloat16": 5.0, "long16_sdpa": 5.0, "long16_amx": 3.6}
    monkeypatch.setattr(tuning, "race", lambda fns, deadline, max_rounds=7: {n: times.get(n, 1.0) for n in fns})
    monkeypatch.setenv(tuning.ENV_KERNEL, "sdpa")
    assert tuning.cpu_attention(torch.bfloat16, 32).kernel == "sdpa"
    monkeypatch.delenv(tuning.ENV_KERNEL)
    tuning.reset()
    auto = tuning.cpu_attention(torch.bfloat16, 32)
    assert (auto.kernel, auto.source) == ("amx", "measured")
    names = set(json.loads(cpu_tuning.cache_path().read_text())[cpu_tuning.machine_key()])
    assert names == {"bfloat16/d32", f"bfloat16/d32 ({tuning.ENV_KERNEL}=sdpa)"}


def test_micro_benchmark_is_short_and_well_formed():
    import time

    t0 = time.perf_counter()
    entry = tuning.measure_cpu_attention(torch.bfloat16, 64, budget_s=0.3)
    assert time.perf_counter() - t0 < 15  # the budget bounds the rounds; first calls come on top (loaded CI)
    assert entry["dtype"] in ("float32", "bfloat16") and entry["matmul_max_len"] in (0, *tuning._MATMUL_LENGTHS)
    assert {"long_float32", "long_bfloat16"} <= set(entry["ms"])  # the short cases run while the budget lasts
    assert entry["matmul_max_len"] == 0 or entry["ms"]["short16_matmul"] < entry["ms"]["short16_sdpa"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 2])
def test_matmul_attention_matches_sdpa(causal, hkv):
    q, k, v = _qkv(3, 4, hkv, 9, 8, torch.float32)
    got = tuning.matmul_attention(q, k, v, causal, 0.3)
    assert_close(got, _reference(q, k, v, causal, 0.3), 1e-5, what="matmul attention")


@pytest.mark.parametrize("choice", ["float32", "input", "matmul"])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_attend_is_exact_every_way(monkeypatch, choice, causal):
    """bf16 inputs attended in float32, in bf16, or by the float32 matmul kernel: within bf16 rounding of
    the float64 reference (the plain model's own bf16 SDPA is what the engine's bf16 tolerance allows)."""
    if choice == "matmul":
        monkeypatch.setattr(tuning, "cpu_attention", lambda dtype, d=64: tuning.CpuAttention(torch.bfloat16, 64, "test"))
    else:
        monkeypatch.setenv(tuning.ENV_DTYPE, choice)
        monkeypatch.setenv(tuning.ENV_KERNEL, "sdpa")
    q, k, v = _qkv(4, 4, 2, 17, 16, torch.bfloat16, seed=3)
    got = tuning.cpu_attend(q, k, v, causal, 0.25, enable_gqa=True)
    want = _reference(q, k, v, causal, 0.25)
    assert_close(got.double(), want, 3e-2, what=f"cpu_attend {choice}")
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.25, enable_gqa=True)  # the plain model's
    err, plain_err = (got.double() - want).abs().max(), (plain.double() - want).abs().max()
    assert err <= 2 * plain_err + 1e-3, (float(err), float(plain_err))


@pytest.mark.parametrize("choice", ["float32", "input"])
@pytest.mark.parametrize("arch", ["bert", "qwen2"])
def test_bf16_engine_within_plain_model_error_either_way(monkeypatch, arch, choice):
    """The whole bf16 engine on the CPU, with its attention forced to float32 or to bf16: both stay within
    the tolerance the engine promises (test_gpu.py's bound: twice the plain per-chunk model's error)."""
    from test_gpu import compare_with_plain_model

    monkeypatch.setenv(tuning.ENV_DTYPE, choice)
    compare_with_plain_model(arch, "cpu", torch.bfloat16)


def test_decisions_name_what_ran():
    assert tuning.decisions() == {} and tuning.describe(torch.bfloat16) == ""
    import os

    os.environ[tuning.ENV_DTYPE] = "float32"
    os.environ[tuning.ENV_KERNEL] = "sdpa"
    try:
        tuning.cpu_attention(torch.bfloat16, 32)
    finally:
        del os.environ[tuning.ENV_DTYPE], os.environ[tuning.ENV_KERNEL]
    assert tuning.describe(torch.bfloat16) == "fp32" and "bfloat16/d32" in tuning.decisions()
