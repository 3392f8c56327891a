"""`dice_fast.cpu_layer_norm` and its kernel (``csrc/layer_norm_cpu.cpp``): bf16 LayerNorm against a
float64 one, within torch's own bf16 error; refusals by name; the measured choice and its overrides;
the engine's bf16 vectors with it, and only the calls it can take routed to it."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dice_fast import DiceEncoder, cpu_layer_norm, cpu_linear
from dice_fast.errors import OptionError

from tiny_models import tiny


def _kernel_or_skip():
    ok, why = cpu_layer_norm.ready()
    if not ok:
        pytest.skip(why)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("DICE_FAST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_layer_norm, "_STATE", {k: v for k, v in cpu_layer_norm._STATE.items() if k == "ready"})
    return tmp_path


def _inputs(rows, h, param_dtype, bias=True, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, h, generator=g) * 3 + offset).to(torch.bfloat16)
    w = torch.randn(h, generator=g).to(param_dtype)
    b = torch.randn(h, generator=g).to(param_dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("h", [1, 7, 16, 31, 32, 33, 384, 768, 1000])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_within_torchs_own_bf16_error(h, param_dtype, bias):
    _kernel_or_skip()
    for rows, offset in ((1, 0.0), (300, 0.0), (50, 1000.0)):
        x, w, b = _inputs(rows, h, param_dtype, bias, offset=offset)
        want = F.layer_norm(x.double(), (h,), w.double(), None if b is None else b.double(), 1e-5)
        got = cpu_layer_norm.layer_norm(x, w, b, 1e-5)
        ours = (got.double() - want).abs().max().item()
        theirs = (F.layer_norm(x, (h,), w, b, 1e-5).double() - want).abs().max().item()
        ulp = want.abs().max().item() * 2.0 ** -8  # one bf16 rounding of the largest output
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert ours <= theirs + ulp, (rows, offset, ours, theirs)


def test_kernel_edge_rows():
    _kernel_or_skip()
    w, b = torch.ones(40, dtype=torch.bfloat16), torch.full((40,), 0.5, dtype=torch.bfloat16)
    flat = torch.full((3, 40), 7.0, dtype=torch.bfloat16)  # zero variance: (x - mean) = 0 -> the bias
    assert torch.equal(cpu_layer_norm.layer_norm(flat, w, b, 1e-12), torch.full((3, 40), 0.5, dtype=torch.bfloat16))
    empty = torch.empty(0, 5, 40, dtype=torch.bfloat16)
    assert cpu_layer_norm.layer_norm(empty, w, b, 1e-5).shape == (0, 5, 40)
    x = torch.randn(2, 3, 40).to(torch.bfloat16)  # leading dimensions are rows
    torch.testing.assert_close(cpu_layer_norm.layer_norm(x, w, b, 1e-5).float(),
                               F.layer_norm(x, (40,), w, b, 1e-5).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case, match", [
    (lambda x, w, b: (x.float(), w, b, 1e-5), "x must be a contiguous bfloat16"),
    (lambda x, w, b: (x.t(), w, b, 1e-5), "x must be a contiguous bfloat16"),
    (lambda x, w, b: (x, w[:-1], b, 1e-5), "weight must be a contiguous CPU vector"),
    (lambda x, w, b: (x, w, b.double(), 1e-5), "bias must be bfloat16 or float32"),
    (lambda x, w, b: (x, w, b, -1.0), "eps must be finite"),
    (lambda x, w, b: (x, w, b, float("nan")), "eps must be finite"),
    (lambda x, w, b: (x[:, :0], w[:0], b[:0], 1e-5), "last dimension of x is empty"),
])
def test_kernel_refuses_by_name(case, match):
    _kernel_or_skip()
    x, w, b = _inputs(8, 32, torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.dice_fast_C.layer_norm_bf16(*case(x, w, b))


def test_applies_only_to_what_the_kernel_takes():
    x, w, b = _inputs(4, 32, torch.bfloat16)
    assert cpu_layer_norm.applies(x, (32,), w, b) and cpu_layer_norm.applies(x, [32], w, None)
    assert cpu_layer_norm.applies(x, (32,), w.float(), b.float())
    assert not cpu_layer_norm.applies(x.float(), (32,), w, b)  # float32 stays on torch
    assert not cpu_layer_norm.applies(x, (4, 32), w, b)  # more than the last dimension
    assert not cpu_layer_norm.applies(x, (32,), None, b)  # no weight
    assert not cpu_layer_norm.applies(x.t().contiguous().t(), (32,), w, b)  # strided rows
    assert not cpu_layer_norm.applies(x, (32,), w.double(), b)
    for eps in (-1.0, float("nan"), float("inf")):  # torch computes something; the kernel would refuse
        assert not cpu_layer_norm.applies(x, (32,), w, b, eps)


def test_env_decides_and_refuses_nonsense(fresh, monkeypatch):
    monkeypatch.setattr(cpu_layer_norm, "measure", lambda *a, **k: pytest.fail("measured although the env decided"))
    monkeypatch.setenv(cpu_layer_norm.ENV, "torch")
    assert cpu_layer_norm.kernel() == "torch"
    monkeypatch.setenv(cpu_layer_norm.ENV, "native")
    assert cpu_layer_norm.kernel() == ("native" if cpu_layer_norm.ready()[0] else "torch")
    monkeypatch.setenv(cpu_layer_norm.ENV, "fast")
    with pytest.raises(OptionError, match=cpu_layer_norm.ENV):
        cpu_layer_norm.kernel()


def test_a_cpu_without_avx512_bf16_never_builds(fresh, monkeypatch):
    from dice_fast.ops import native

    monkeypatch.setattr(cpu_layer_norm, "_STATE", {})
    monkeypatch.setattr(cpu_layer_norm.tuning, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(native, "build", lambda *a, **k: pytest.fail("built the extension on a CPU it cannot serve"))
    monkeypatch.delenv(cpu_layer_norm.ENV, raising=False)
    assert cpu_layer_norm.kernel() == "torch"
    assert "avx512_bf16" in cpu_layer_norm.ready()[1]


def test_measured_once_and_cached_per_machine(fresh, monkeypatch):
    _kernel_or_skip()
    monkeypatch.delenv(cpu_layer_norm.ENV, raising=False)
    entries = []
    real = cpu_layer_norm.measure
    monkeypatch.setattr(cpu_layer_norm, "measure", lambda: entries.append(real(budget_s=0.05)) or entries[-1])
    monkeypatch.setattr(cpu_layer_norm.tuning, "busy", lambda load: False)
    first = cpu_layer_norm.kernel()
    assert first in cpu_layer_norm.KERNELS and len(entries) == 1 and set(entries[0]["ms"]) == {"torch", "native"}
    assert cpu_layer_norm.kernel() == first and len(entries) == 1
    cached = json.loads((fresh / "cpu_tuning.json").read_text())
    assert next(iter(cached.values()))["layer_norm/bfloat16"]["kernel"] == first
    monkeypatch.setattr(cpu_layer_norm, "_STATE", {"ready": cpu_layer_norm.ready()})  # a new process reads the file
    assert cpu_layer_norm.kernel() == first and len(entries) == 1


def test_engine_bf16_with_the_kernel(fresh, monkeypatch):
    """bf16 vectors with the kernel agree with torch's LayerNorm's to bf16 rounding, the kernel ran on
    every LayerNorm, and a float32 model's LayerNorms never reach it."""
    _kernel_or_skip()
    if not cpu_linear.available(torch.bfloat16):
        pytest.skip("no bf16 linear on this CPU")
    model, tok, *_ = tiny("bert")
    texts = ["the cat sat on a mat and the dog ran to a big red house " * 5, "a short one"]
    out, calls = {}, []
    real = cpu_layer_norm.layer_norm
    monkeypatch.setattr(cpu_layer_norm, "layer_norm", lambda *a: calls.append(1) or real(*a))
    for name in cpu_layer_norm.KERNELS:
        monkeypatch.setenv(cpu_layer_norm.ENV, name)
        monkeypatch.setattr(cpu_layer_norm, "_STATE", {"ready": cpu_layer_norm.ready()})
        calls.clear()
        enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=16, dtype="bfloat16")
        out[name] = enc.encode_documents(texts)
        assert (len(calls) > 0) == (name == "native"), (name, len(calls))
        assert ("cpu_layer_norm=native" in repr(enc)) == (name == "native")
    assert float((out["native"] * out["torch"]).sum(1).min()) > 0.999
    calls.clear()
    DiceEncoder(model, tok, chunk_size=16).encode_documents(texts)  # float32
    assert calls == []
    np.testing.assert_equal(out["native"].dtype, np.float32)
