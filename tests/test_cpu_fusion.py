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
from dice_fast.errors import ModelError, OptionError

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


@pytest.fixture(autouse=True)
def fusing(monkeypatch):
    """The mechanism under test runs wherever oneDNN does (``on``); whether it pays here is `fuses`' race,
    tested on its own below."""
    monkeypatch.setenv(cpu_fusion.ENV, "on")


def found(model) -> dict[int, str]:
    """{id(weight): approximate} of `cpu_fusion.gelu_pairs`."""
    return {id(p.weight): p.approximate for p in cpu_fusion.gelu_pairs(model)}


def test_finds_each_linear_feeding_only_a_gelu():
    assert list(found(Block()).values()) == ["none"]
    assert list(found(Block(extra="tanh")).values()) == ["tanh"]
    assert list(found(Block(nn.GELU(approximate="tanh"))).values()) == ["tanh"]
    block = Block()
    assert set(found(nn.Sequential(block))) == {id(block.dense.weight)}


@pytest.mark.parametrize("make", [
    lambda: Block(extra="reuse"),  # the linear's output is read twice
    lambda: Block(extra="scaled"),  # something between the linear and the GELU
    lambda: Block(nn.SiLU()),
    lambda: Block(nn.Sequential(nn.Dropout(0.0), nn.GELU())),
])
def test_leaves_anything_else_alone(make):
    assert found(make()) == {}


def test_a_shared_weight_or_module_or_a_hook_is_not_fused():
    a, b = Block(), Block()
    b.dense.weight = a.dense.weight  # tied: the other linear's output would be activated too
    assert found(nn.ModuleList([a, b])) == {}
    shared = nn.Linear(24, 40)
    c, d = Block(), Block()
    c.dense = d.dense = shared
    assert found(nn.ModuleList([c, d])) == {}
    for target in ("dense", "act", "self"):
        block = Block(nn.GELU())
        module = block if target == "self" else getattr(block, target)
        handle = module.register_forward_hook(lambda *a: None)
        assert found(block) == {}, target
        handle.remove()
        assert found(block) != {}
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert found(Block()) == {}
    finally:
        handle.remove()


def test_env_switches_it_off_and_refuses_nonsense(monkeypatch):
    monkeypatch.setenv(cpu_fusion.ENV, "off")
    assert found(Block()) == {}
    monkeypatch.setenv(cpu_fusion.ENV, "maybe")
    with pytest.raises(OptionError, match=f"{cpu_fusion.ENV} must be auto, on or off"):
        found(Block())


@needs_onednn
def test_auto_fuses_only_where_the_race_says_it_pays(monkeypatch, tmp_path):
    """Fusing was always on, measured only on an AMX Xeon; on a Zen 2 oneDNN's GELU post-op made the pair
    ~20 % slower and the bundled model's forward 6 %. auto (the default) races the two once per machine
    and dtype (cached), and finds no pairs where apart wins."""
    monkeypatch.setenv(cpu_fusion.ENV, "auto")
    monkeypatch.setenv("DICE_FAST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_fusion, "_DECIDED", {})
    entry = cpu_fusion.measure(torch.float32, budget_s=0.3)  # the real race, briefly
    assert entry["kernel"] in ("fused", "apart") and set(entry["ms"]) == {"fused", "apart"}
    assert (entry["kernel"] == "fused") == (entry["ms"]["fused"] < cpu_fusion.MARGIN * entry["ms"]["apart"])
    for winner, pairs in (("apart", 0), ("fused", 1)):
        monkeypatch.setattr(cpu_fusion, "_DECIDED", {})
        monkeypatch.setattr(cpu_fusion, "measure", lambda dtype, w=winner: {**entry, "kernel": w, "busy": True})
        assert len(found(Block())) == pairs  # busy: decided for this process, not cached
    calls = []
    monkeypatch.setattr(cpu_fusion, "_DECIDED", {})
    monkeypatch.setattr(cpu_fusion, "measure", lambda dtype: calls.append(dtype) or {**entry, "kernel": "apart", "busy": False})
    assert not cpu_fusion.fuses(torch.float32) and not cpu_fusion.fuses(torch.float32)
    monkeypatch.setattr(cpu_fusion, "_DECIDED", {})  # a new process: read from the cache file
    assert not cpu_fusion.fuses(torch.float32) and calls == [torch.float32]


@pytest.mark.parametrize("arch, count", [("bert", 2), ("roberta", 2), ("mpnet", 2), ("deberta-v2", 2),
                                         ("llama", 0), ("t5-encoder", 0), ("modernbert", 0)])
def test_the_architectures_pattern(arch, count):
    """One linear per layer on the BERT family (MPNet, DeBERTa-v2 included); none in a GLU or ReLU MLP."""
    assert len(found(tiny(arch)[0])) == count


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
    gelu = cpu_fusion.active(cpu_fusion.gelu_pairs(block))
    with cpu_linear.linear_mode("onednn", lambda *a: calls.append(a[3:]) or real(*a), gelu):
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
    assert len(enc.runner._gelu_pairs) == 2 and calls.count(("none",)) >= 2
    assert "cpu_linear=onednn (2 with gelu)" in repr(enc)


@needs_onednn
def test_bf16_fused_agrees_with_float32_at_least_as_well(monkeypatch):
    if not cpu_linear.available(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 linear on this CPU")
    model, tok, *_ = tiny("bert")
    want = DiceEncoder(model, tok, chunk_size=16).encode_documents(TEXTS)
    monkeypatch.setenv(cpu_linear.ENV_KERNEL, "onednn")
    real = cpu_linear.onednn_linear
    cos, fused = {}, {}
    for mode in ("on", "off"):
        monkeypatch.setenv(cpu_fusion.ENV, mode)
        calls = []
        monkeypatch.setattr(cpu_linear, "onednn_linear", lambda *a, calls=calls: calls.append(a[3:]) or real(*a))
        got = DiceEncoder(copy.deepcopy(model), tok, chunk_size=16, dtype="bfloat16").encode_documents(TEXTS)
        cos[mode], fused[mode] = float((got * want).sum(1).min()), calls.count(("none",))
    assert fused["on"] >= 2 and fused["off"] == 0, fused
    assert cos["on"] >= 0.999 and cos["on"] >= cos["off"] - 2e-4, cos


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
    calls.clear()  # the construction's eager probe fuses too; count the compiled forward's calls only
    np.testing.assert_allclose(enc.encode_documents(TEXTS), eager, atol=1e-5)
    assert calls.count(("none",)) >= 2 and calls.count((None,)) >= 2


class Outer(nn.Module):
    """Calls its block's linear a second time from outside the block: the fused output would be wrong."""

    def __init__(self):
        super().__init__()
        self.inter = Block(nn.GELU())

    def forward(self, x):
        return self.inter(x) + self.inter.dense(x)


@needs_onednn
def test_a_fused_linear_read_by_anything_but_its_gelu_raises():
    outer = Outer()
    x = torch.randn(2, 3, 24)
    gelu = cpu_fusion.active(cpu_fusion.gelu_pairs(outer))
    assert len(gelu) == 1
    with pytest.raises(ModelError, match=cpu_fusion.ENV), cpu_linear.linear_mode("onednn", gelu=gelu):
        outer(x)
    with cpu_linear.linear_mode("onednn", gelu={}):  # apart, it runs
        torch.testing.assert_close(outer(x), F.gelu(outer.inter.dense(x)) + outer.inter.dense(x))


class Tail(nn.Module):
    """Returns its block's linear output last, with no torch call after it inside the mode."""

    def __init__(self):
        super().__init__()
        self.inter = Block(nn.GELU())

    def forward(self, x):
        return self.inter(x), self.inter.dense(x)


@needs_onednn
def test_a_fused_output_leaving_the_forward_raises():
    tail = Tail()
    gelu = cpu_fusion.active(cpu_fusion.gelu_pairs(tail))
    with pytest.raises(ModelError, match=cpu_fusion.ENV), cpu_linear.linear_mode("onednn", gelu=gelu):
        tail(torch.randn(2, 24))


@needs_onednn
@pytest.mark.parametrize("hook", ["backward", "global backward"])
def test_a_backward_hook_keeps_its_pair_apart(hook):
    """nn.Module takes its slow path for a backward hook too, which reads the output's requires_grad."""
    block = Block(nn.GELU())
    pairs = cpu_fusion.gelu_pairs(block)
    assert len(pairs) == 1
    handle = (block.dense.register_full_backward_hook(lambda *a: None) if hook == "backward"
              else nn.modules.module.register_module_full_backward_hook(lambda *a: None))
    try:
        assert cpu_fusion.active(pairs) == {}
        assert (found(Block(nn.GELU())) == {}) == (hook == "global backward")  # a new search sees the global one
        x = torch.randn(4, 24)
        with torch.inference_mode(), cpu_linear.linear_mode("onednn", gelu=cpu_fusion.active(pairs)):
            got = block(x)
        torch.testing.assert_close(got, F.gelu(F.linear(x, block.dense.weight, block.dense.bias)), atol=1e-5, rtol=1e-5)
    finally:
        handle.remove()


class Stateful(nn.Module):
    """A parent with a buffer of its own that its forward updates: never run by the search."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(24, 40)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return F.gelu(self.dense(x))


def test_a_parent_with_state_is_never_run():
    module = Stateful()
    assert found(module) == {} and module.calls.item() == 0


@needs_onednn
def test_a_hook_added_after_the_pairs_were_found_keeps_its_pair_apart():
    block = Block(nn.GELU())
    pairs = cpu_fusion.gelu_pairs(block)
    seen = []
    block.dense.register_forward_hook(lambda m, i, o: seen.append(o.clone()))
    assert cpu_fusion.active(pairs) == {}
    x = torch.randn(4, 24)
    with cpu_linear.linear_mode("onednn", gelu=cpu_fusion.active(pairs)):
        block(x)
    torch.testing.assert_close(seen[0], F.linear(x, block.dense.weight, block.dense.bias), atol=1e-5, rtol=1e-5)


class Passthrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(24, 24)

    def forward(self, x):
        return x


def test_odd_modules_are_left_alone_without_error():
    assert found(Passthrough()) == {}  # one linear, never called
    assert found(nn.Linear(24, 40)) == {}  # no children


def test_finding_pairs_does_not_disturb_other_threads():
    """The analysis runs modules under a thread-local recording mode: another thread's forwards meanwhile
    run as usual (torch.fx's tracer, tried first, patches nn.Module for the whole process)."""
    import threading

    other = nn.Sequential(nn.Linear(24, 24), nn.LayerNorm(24))
    x = torch.randn(8, 24)
    want = other(x)
    errors, stop = [], threading.Event()

    def work():
        while not stop.is_set():
            try:
                torch.testing.assert_close(other(x), want)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return

    t = threading.Thread(target=work)
    t.start()
    try:
        for _ in range(200):
            assert len(found(nn.Sequential(Block(), Block(nn.GELU())))) == 2  # this thread's calls only
    finally:
        stop.set()
        t.join()
    assert errors == []
