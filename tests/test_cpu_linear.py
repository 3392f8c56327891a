"""`dice_fast.cpu_linear`: the CPU linear kernel (torch's own or oneDNN's) measured per machine, the mode
that swaps it in during a forward without touching the model, and the engine's vectors under either."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dice_fast import DiceEncoder, cpu_linear
from dice_fast.errors import OptionError

from tiny_models import tiny

needs_onednn = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN linear")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("DICE_FAST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "_DECIDED", {})
    return tmp_path


@needs_onednn
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("shape", [(7, 24), (2, 5, 24), (1, 1, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_mode_matches_torch_linear(dtype, atol, shape, bias):
    if not cpu_linear.available(dtype):
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(dtype)
    w, b = torch.randn(13, 24, generator=g).to(dtype), torch.randn(13, generator=g).to(dtype) if bias else None
    want = F.linear(x, w, b)
    calls = []
    with cpu_linear.linear_mode("onednn", lambda *a: calls.append(1) or cpu_linear.onednn_linear(*a)):
        got = F.linear(x, w, b)
        torch.nn.Linear(24, 13).to(torch.float64)(x.double())  # float64 is left to torch
    assert len(calls) == 1 and got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
    with cpu_linear.linear_mode("torch"):
        assert torch.equal(F.linear(x, w, b), want)


@needs_onednn
@pytest.mark.parametrize("bias", ["strided", "scalar", "broadcast"])
def test_a_bias_onednn_cannot_take_goes_to_torch(bias):
    """oneDNN reads a bias as a flat (out,) buffer: a strided, 0-d or (1,) broadcast bias would be read
    wrong (max error 1.26 on a strided one), so the mode leaves such linears to torch's kernel."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 24, generator=g), torch.randn(13, 24, generator=g)
    b = {"strided": torch.randn(26, generator=g)[::2], "scalar": torch.tensor(0.5), "broadcast": torch.randn(1, generator=g)}[bias]
    calls = []
    with cpu_linear.linear_mode("onednn", lambda *a: calls.append(1) or cpu_linear.onednn_linear(*a)):
        got = F.linear(x, w, b)
    assert calls == [] and torch.equal(got, F.linear(x, w, b))


def test_env_decides_without_measuring(fresh, monkeypatch):
    monkeypatch.setattr(cpu_linear, "measure", lambda *a, **k: pytest.fail("measured although the env decided"))
    monkeypatch.setenv(cpu_linear.ENV_KERNEL, "torch")
    assert cpu_linear.kernel(torch.float32) == "torch"
    monkeypatch.setenv(cpu_linear.ENV_KERNEL, "onednn")
    assert cpu_linear.kernel(torch.float32) == ("onednn" if cpu_linear.available() else "torch")
    assert cpu_linear.kernel(torch.float64) == "torch"  # only float32 / bfloat16 have a choice
    monkeypatch.setenv(cpu_linear.ENV_KERNEL, "fast")
    with pytest.raises(OptionError, match=cpu_linear.ENV_KERNEL):
        cpu_linear.kernel(torch.float32)


def test_a_dtype_onednn_cannot_run_stays_on_torch(fresh, monkeypatch):
    """oneDNN builds no bf16 linear on an AVX2-only CPU (Zen 3: "could not create a primitive descriptor");
    such a dtype keeps torch's kernel without a race, whatever the env asks."""
    def refuse(x, w, b):
        raise RuntimeError("could not create a primitive descriptor for the inner product forward propagation primitive")

    monkeypatch.setattr(cpu_linear, "onednn_linear", refuse)
    monkeypatch.setattr(cpu_linear, "_RUNS", {})
    monkeypatch.setattr(cpu_linear, "measure", lambda *a, **k: pytest.fail("raced a kernel that cannot run"))
    for env in ("auto", "onednn"):
        monkeypatch.setenv(cpu_linear.ENV_KERNEL, env)
        assert cpu_linear.kernel(torch.bfloat16) == "torch"
    assert not cpu_linear.available(torch.bfloat16)


@needs_onednn
def test_measured_once_and_cached_per_machine(fresh, monkeypatch):
    monkeypatch.delenv(cpu_linear.ENV_KERNEL, raising=False)
    entries = []
    real = cpu_linear.measure
    monkeypatch.setattr(cpu_linear, "measure", lambda dtype: entries.append(real(dtype, budget_s=0.05)) or entries[-1])
    monkeypatch.setattr(cpu_linear.tuning, "busy", lambda load: False)
    first = cpu_linear.kernel(torch.float32)
    assert first in cpu_linear.KERNELS and len(entries) == 1 and set(entries[0]["ms"]) == {"torch", "onednn"}
    assert cpu_linear.kernel(torch.float32) == first and len(entries) == 1  # the process keeps it
    cached = json.loads((fresh / "cpu_tuning.json").read_text())
    assert next(iter(cached.values()))["linear/float32"]["kernel"] == first
    monkeypatch.setattr(cpu_linear, "_DECIDED", {})  # a new process reads the file
    assert cpu_linear.kernel(torch.float32) == first and len(entries) == 1


@needs_onednn
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_engine_vectors_under_either_kernel(fresh, monkeypatch, arch):
    """The packed and padded forwards run their linears through the chosen kernel; either kernel gives the
    same vectors to float32 rounding, and the model is not modified."""
    model, tok, *_ = tiny(arch)
    texts = ["the cat sat on a mat and the dog ran to a big red house " * 5, "a short one"]
    out = {}
    for name in cpu_linear.KERNELS:
        monkeypatch.setenv(cpu_linear.ENV_KERNEL, name)
        calls = []
        real = cpu_linear.onednn_linear
        monkeypatch.setattr(cpu_linear, "onednn_linear", lambda *a, real=real: calls.append(1) or real(*a))
        enc = DiceEncoder(model, tok, chunk_size=16)
        out[name] = enc.encode_documents(texts, return_chunks=True).chunks
        assert (len(calls) > 0) == (name == "onednn"), (name, len(calls))
        monkeypatch.setattr(cpu_linear, "onednn_linear", real)
    np.testing.assert_allclose(out["onednn"], out["torch"], atol=1e-5)
    assert not any(isinstance(m, torch.overrides.TorchFunctionMode) for m in model.modules())
