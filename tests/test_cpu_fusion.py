"""`dice_fast.cpu_fusion`: which linears feed only a GELU (found by tracing, never by name), and the CPU
forward that runs each such pair as one oneDNN call: the same vectors as the plain forward, eager and
compiled, on every architecture that has the pattern, and nothing fused where anything else could see
the linear's output."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dice_fast import DiceEncoder, cpu_fusion, cpu_linear
from dice_fast.errors import OptionError

from oracle import check
from tiny_models import tiny

needs_onednn = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN linear")
TEXTS = ["the cat sat on a mat and the dog ran to a big red house " * 5, "a short one", "alpha beta " * 9]


class Block(nn.Module):
    """A feed-forward block of the shape under test: ``act(dense(x))``, optionally with ``extra`` applied."""

    def __init__(self, act: nn.Module | None = None, extra: str = ""):
        super().__init__()
        self.dense = nn.Linear(24, 40)
        self.act = act
        self.extra = extra

    def forward(self, x):
        h = self.dense(x)
        if self.extra == "reuse":
            return F.gelu(h) + h
        if self.extra == "scaled":
            return F.gelu(h * 2.0)
        if self.act is not None:
            return self.act(h)
        return F.gelu(h, approximate="tanh") if self.extra == "tanh" else F.gelu(h)


def test_finds_each_linear_feeding_only_a_gelu():
    assert list(cpu_fusion.gelu_linears(Block()).values()) == ["none"]
    assert list(cpu_fusion.gelu_linears(Block(extra="tanh")).values()) == ["tanh"]
    assert list(cpu_fusion.gelu_linears(Block(nn.GELU(approximate="tanh"))).values()) == ["tanh"]
    block = Block()
    assert set(cpu_fusion.gelu_linears(nn.Sequential(block))) == {id(block.dense.weight)}


@pytest.mark.parametrize("make", [
    lambda: Block(extra="reuse"),  # the linear's output is read twice
    lambda: Block(extra="scaled"),  # something between the linear and the GELU
    lambda: Block(nn.SiLU()),
    lambda: Block(nn.Sequential(nn.Dropout(0.0), nn.GELU())),
])
def test_leaves_anything_else_alone(make):
    assert cpu_fusion.gelu_linears(make()) == {}


def test_a_shared_weight_or_module_or_a_hook_is_not_fused():
    a, b = Block(), Block()
    b.dense.weight = a.dense.weight  # tied: the other linear's output would be activated too
    assert cpu_fusion.gelu_linears(nn.ModuleList([a, b])) == {}
    shared = nn.Linear(24, 40)
    c, d = Block(), Block()
    c.dense = d.dense = shared
    assert cpu_fusion.gelu_linears(nn.ModuleList([c, d])) == {}
    for target in ("dense", "act", "self"):
        block = Block(nn.GELU())
        module = block if target == "self" else getattr(block, target)
        handle = module.register_forward_hook(lambda *a: None)
        assert cpu_fusion.gelu_linears(block) == {}, target
        handle.remove()
        assert cpu_fusion.gelu_linears(block) != {}
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert cpu_fusion.gelu_linears(Block()) == {}
    finally:
        handle.remove()


def test_env_switches_it_off_and_refuses_nonsense(monkeypatch):
    monkeypatch.setenv(cpu_fusion.ENV, "off")
    assert cpu_fusion.gelu_linears(Block()) == {}
    monkeypatch.setenv(cpu_fusion.ENV, "maybe")
    with pytest.raises(OptionError, match=cpu_fusion.ENV):
        cpu_fusion.gelu_linears(Block())


@pytest.mark.parametrize("arch, count", [("bert", 2), ("roberta", 2), ("mpnet", 2), ("deberta-v2", 2),
                                         ("llama", 0), ("t5-encoder", 0), ("modernbert", 0)])
def test_the_architectures_pattern(arch, count):
    """One linear per layer on the BERT family (MPNet, DeBERTa-v2 included); none in a GLU or ReLU MLP."""
    assert len(cpu_fusion.gelu_linears(tiny(arch)[0])) == count


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_mode_runs_the_pair_as_one_call(dtype, approximate):
    if not cpu_linear.available(dtype):
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU")
    block = Block(nn.GELU(approximate=approximate)).to(dtype)
    x = torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = F.gelu(F.linear(x.float(), block.dense.weight.float(), block.dense.bias.float()), approximate=approximate)
    calls = []
    real = cpu_linear.onednn_linear
    with cpu_linear.linear_mode("onednn", lambda *a: calls.append(a[3:]) or real(*a), cpu_fusion.gelu_linears(block)):
        got = block(x)
        other = F.gelu(x)  # a GELU of anything else runs as usual
    assert calls == [(approximate,)]
    torch.testing.assert_close(other, F.gelu(x))
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@needs_onednn
@pytest.mark.parametrize("arch", ["bert", "mpnet", "deberta-v2"])
def test_engine_fused_matches_the_per_chunk_oracle(monkeypatch, arch):
    """float32 through oneDNN's linears, fused: every document and chunk vector equals the per-chunk
    Hugging Face forward's to float32 rounding, packed (BERT) and on the padded fallback (MPNet,
    DeBERTa-v2); the fused call really ran."""
    monkeypatch.setenv(cpu_linear.ENV_KERNEL, "onednn")
    calls = []
    real = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear", lambda *a: calls.append(a[3:]) or real(*a))
    enc, _ = check(arch)
    assert len(enc.runner._gelu_linears) == 2 and calls.count(("none",)) >= 2
    assert "cpu_linear=onednn (2 with gelu)" in repr(enc)


@needs_onednn
def test_bf16_fused_agrees_with_float32_at_least_as_well():
    if not cpu_linear.available(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 linear on this CPU")
    model, tok, *_ = tiny("bert")
    want = DiceEncoder(model, tok, chunk_size=16).encode_documents(TEXTS)
    cos = {}
    for mode in ("on", "off"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cpu_linear.ENV_KERNEL, "onednn")
            mp.setenv(cpu_fusion.ENV, mode)
            enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=16, dtype="bfloat16")
            got = enc.encode_documents(TEXTS)
        cos[mode] = float((got * want).sum(1).min() / 1.0)
    assert cos["on"] >= 0.999 and cos["on"] >= cos["off"] - 1e-3, cos


@needs_onednn
def test_compiled_forward_fuses_too(monkeypatch):
    from dice_fast import compiled

    monkeypatch.setenv(cpu_linear.ENV_KERNEL, "onednn")
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model, tok, *_ = tiny("bert")
    eager = DiceEncoder(model, tok, chunk_size=16).encode_documents(TEXTS)
    calls = []
    real = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear", lambda *a: calls.append(a[3:]) or real(*a))
    enc = DiceEncoder(model, tok, chunk_size=16, compile="on")
    assert len(enc.runner.compiled._gelu) == 2
    np.testing.assert_allclose(enc.encode_documents(TEXTS), eager, atol=1e-5)
    assert ("none",) in calls
