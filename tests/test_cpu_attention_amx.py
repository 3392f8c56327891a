"""The AMX attention kernel (``csrc/attention_cpu_amx.cpp``, `dice_fast.cpu_attention`): exact against a
float64 SDPA within the error of torch's own bf16 SDPA, at every length and layout the engine passes,
never run where it does not apply, refusing bad input by name, and the whole bf16 engine with it within
the plain per-chunk model's error.

The kernel tests run where the CPU has AMX bf16 (an Intel Xeon of Sapphire Rapids or later); the
argument checks wherever the C++ extension builds."""

from __future__ import annotations

import copy
import json
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dice_fast import DiceEncoder
from dice_fast import cpu_attention as tuning
from dice_fast import cpu_tuning
from oracle import K, corpus
from reference import reference_encode
from test_cpu_attention import _isolated  # noqa: F401 - the autouse fixture: own cache folder, no overrides
from test_gpu import assert_within_plain_error
from tiny_models import tiny


@pytest.fixture(scope="module")
def built():
    """The loaded extension; skips where it cannot be built (no compiler or ninja)."""
    from dice_fast.ops import native

    if not native.is_loaded():
        try:
            native.build()
        except RuntimeError as e:
            pytest.skip(f"the dice_fast C++ extension does not build here: {str(e)[:200]}")
    return torch.ops.dice_fast_C


@pytest.fixture(scope="module")
def amx(built):
    ok, why = tuning.amx_kernel()
    if not ok:
        pytest.skip(f"no AMX attention here: {why}")
    return built.amx_attention


def _packed(n, heads, length, d, seed=0, scale_q=1.0):
    """q, k, v as the engine passes them: (n, H, L, D) strided views of packed (tokens, H, D)
    projections; out a view of a packed (tokens, H, D) buffer."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n * length, 3, heads, d, generator=g)
    qkv[:, 0] *= scale_q
    q, k, v = (qkv[:, i].bfloat16().view(n, length, heads, d).transpose(1, 2) for i in range(3))
    out = torch.full((n * length, heads, d), float("nan"), dtype=torch.bfloat16)
    return q, k, v, out


def _errors(q, k, v, got, scale):
    """(max abs error of ``got``, of torch's bf16 SDPA) against float64 SDPA of the same bf16 inputs."""
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
    plain = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return float((got.double() - want).abs().max()), float((plain.double() - want).abs().max())


# lengths: one token, under / at / over a 16-row block and a 32-key step, the engine's 256, the limit
@pytest.mark.parametrize("n,heads,length,d", [
    (2, 3, 1, 32), (2, 3, 15, 32), (2, 3, 16, 32), (2, 3, 17, 32), (3, 2, 31, 64), (3, 2, 33, 64), (2, 2, 47, 32),
    (1, 12, 256, 32), (2, 4, 257, 64), (1, 3, 300, 32), (1, 2, 1024, 32), (1, 2, 1024, 64),
])
def test_kernel_within_bf16_sdpa_error(amx, n, heads, length, d):
    q, k, v, out = _packed(n, heads, length, d, seed=length)
    dst = out.view(n, length, heads, d).transpose(1, 2)
    amx(q, k, v, dst, d**-0.5)
    err, plain_err = _errors(q, k, v, dst, d**-0.5)
    assert not torch.isnan(out).any(), "a row of the packed output was left unwritten"
    assert err <= 1.5 * plain_err + 2e-3, (err, plain_err)


def test_kernel_peaked_and_flat_softmax(amx):
    """Scores far apart (softmax ~ one-hot: exp underflows to 0 for most keys) and all equal (uniform)."""
    q, k, v, out = _packed(2, 2, 100, 32, seed=7, scale_q=40.0)
    dst = out.view(2, 100, 2, 32).transpose(1, 2)
    amx(q, k, v, dst, 32**-0.5)
    err, plain_err = _errors(q, k, v, dst, 32**-0.5)
    assert torch.isfinite(out).all() and err <= 1.5 * plain_err + 2e-3, (err, plain_err)
    flat = torch.zeros_like(q)
    amx(flat, k, v, dst, 32**-0.5)
    torch.testing.assert_close(dst.float(), v.float().mean(dim=2, keepdim=True).expand_as(v), atol=1e-2, rtol=0)


def test_kernel_writes_only_its_output(amx):
    q, k, v, _ = _packed(2, 2, 20, 32)
    buf = torch.full((2 * 20 + 6, 2, 32), 7.0, dtype=torch.bfloat16)  # 3 sentinel rows either side
    dst = buf[3:43].view(2, 20, 2, 32).transpose(1, 2)
    amx(q, k, v, dst, 0.2)
    assert (buf[:3] == 7).all() and (buf[43:] == 7).all()
    amx(q[:0], k[:0], v[:0], dst[:0], 0.2)  # no chunks: nothing to do


def test_kernel_beside_onednn_amx_linears_and_threads(amx):
    """oneDNN's bf16 linears also run on AMX tiles in the same threads: interleaved with them, and from
    two Python threads at once, every result is what it is alone (the tile configuration is put back)."""
    q, k, v, _ = _packed(4, 12, 64, 32, seed=3)
    x, w = torch.randn(512, 384).bfloat16(), torch.randn(1536, 384).bfloat16()
    linear = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    want_attn, want_lin = torch.empty_like(q), linear()
    amx(q, k, v, want_attn, 0.17)
    failures = []

    def work():
        for _ in range(20):
            got = torch.empty_like(q)
            amx(q, k, v, got, 0.17)
            if not (torch.equal(got, want_attn) and torch.equal(linear(), want_lin)):
                failures.append("differs")

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_kernel_refuses_bad_input_by_name(built):
    q, k, v, out = _packed(1, 2, 8, 32)
    op = built.amx_attention
    dst = out.view(1, 8, 2, 32).transpose(1, 2)
    with pytest.raises(RuntimeError, match="q must be bfloat16"):
        op(q.float(), k, v, dst, 1.0)
    with pytest.raises(RuntimeError, match="v has shape"):
        op(q, k, v[:, :1], dst, 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be 32 or 64"):
        op(q[..., :16], k[..., :16], v[..., :16], dst[..., :16], 1.0)
    with pytest.raises(RuntimeError, match="k's head_dim must be contiguous"):
        op(q, torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)[..., ::2], v, dst, 1.0)
    with pytest.raises(RuntimeError, match="length must be at most 1024"):
        big = torch.zeros(1, 1, 1025, 32, dtype=torch.bfloat16)
        op(big, big, big, big.clone(), 1.0)
    with pytest.raises(RuntimeError, match=r"out must be \(n, heads, length, head_dim\)"):
        op(q, k, v, out, 1.0)
    with pytest.raises(RuntimeError, match="scale must be positive and finite"):
        op(q, k, v, dst, -0.2)
    with pytest.raises(RuntimeError, match="scale must be positive and finite"):
        op(q, k, v, dst, float("nan"))
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):  # rows sharing memory
        op(q, k, v, torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16).expand(1, 2, 8, 32), 1.0)
    base = torch.zeros(9 * 2 * 32, dtype=torch.bfloat16)  # out one token past q in the same buffer
    shifted = [base[o:o + 8 * 2 * 32].view(1, 8, 2, 32).transpose(1, 2) for o in (0, 64)]
    with pytest.raises(RuntimeError, match="input tensor and the written-to tensor refer to a single memory location"):
        op(shifted[0], k, v, shifted[1], 1.0)


def test_cpu_attend_uses_the_kernel_only_where_it_applies(amx, monkeypatch):
    """Causal, masked, GQA and head sizes other than 32 / 64 go to SDPA, bit for bit."""
    monkeypatch.setattr(tuning, "cpu_attention", lambda dtype, d=64: tuning.CpuAttention(dtype, 0, "test", "amx"))
    q, k, v, out = _packed(2, 4, 24, 32)
    dst = out.view(2, 24, 4, 32).transpose(1, 2)
    assert tuning.cpu_attend(q, k, v, False, 0.2, out=dst) is dst  # written in place
    for other in (None, dst.float(), torch.empty(2, 4, 32, 24, dtype=torch.bfloat16).transpose(2, 3)):
        got = tuning.cpu_attend(q, k, v, False, 0.2, out=other)  # no out, or one it cannot take: a tensor of its own
        assert got is not other and torch.equal(got, dst)
    sdpa = lambda **kw: F.scaled_dot_product_attention(q, k, v, scale=0.2, **kw)  # noqa: E731
    assert torch.equal(tuning.cpu_attend(q, k, v, True, 0.2), sdpa(is_causal=True))
    band = torch.ones(24, 24, dtype=torch.bool).tril(3).triu(-3)
    assert torch.equal(tuning.cpu_attend(q, k, v, False, 0.2, mask=band), sdpa(attn_mask=band))
    q16, k16, v16, _ = _packed(2, 4, 24, 16)
    assert torch.equal(tuning.cpu_attend(q16, k16, v16, False, 0.2),
                       F.scaled_dot_product_attention(q16, k16, v16, scale=0.2))
    assert torch.equal(tuning.cpu_attend(q, k[:, :2], v[:, :2], False, 0.2, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], scale=0.2, enable_gqa=True))


def test_measured_choice_and_overrides(amx, monkeypatch):
    entry = tuning.measure_cpu_attention(torch.bfloat16, 32, budget_s=0.3)
    assert entry["kernel"] in ("sdpa", "amx") and {"long16_sdpa", "long16_amx"} <= set(entry["ms"])
    assert (entry["kernel"] == "amx") == (entry["ms"]["long16_amx"] < 0.9 * entry["ms"]["long16_sdpa"])
    monkeypatch.setenv(tuning.ENV_KERNEL, "amx")
    assert tuning.cpu_attention(torch.bfloat16, 32) == tuning.CpuAttention(torch.bfloat16, 0, "env", "amx")
    assert tuning.describe(torch.bfloat16) == "bf16 amx"
    monkeypatch.setenv(tuning.ENV_KERNEL, "sdpa")
    assert tuning.cpu_attention(torch.bfloat16, 32).kernel == "sdpa"


def test_amx_override_refused_where_the_kernel_cannot_run(monkeypatch):
    monkeypatch.setattr(tuning, "_AMX", {"ok": False, "why": "this CPU has no AMX bf16 (amx_tile, amx_bf16 and avx512_bf16)"})
    monkeypatch.setenv(tuning.ENV_KERNEL, "amx")
    with pytest.raises(ValueError, match="DICE_FAST_CPU_ATTENTION_KERNEL=amx.*no AMX bf16"):
        tuning.cpu_attention(torch.bfloat16, 32)
    assert tuning.cpu_attention(torch.float32, 32).kernel == "sdpa"  # float32 never runs it: not refused
    monkeypatch.setenv(tuning.ENV_DTYPE, "float32")
    with pytest.raises(ValueError, match="DICE_FAST_CPU_ATTENTION_DTYPE=float32 contradicts it"):
        tuning.cpu_attention(torch.bfloat16, 32)


def test_cached_amx_choice_falls_back_where_the_kernel_cannot_run(monkeypatch):
    """A cache shared with an AMX machine (or written before the extension stopped building): SDPA runs."""
    entry = {"dtype": "bfloat16", "matmul_max_len": 0, "kernel": "amx", "ms": {}, "race": cpu_tuning.RACE_VERSION}
    path = cpu_tuning.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({cpu_tuning.machine_key(): {"bfloat16/d32": entry}}))
    monkeypatch.setattr(tuning, "_AMX", {"ok": False, "why": "the dice_fast C++ extension did not build"})
    got = tuning.cpu_attention(torch.bfloat16, 32)
    assert (got.source, got.kernel, got.dtype) == ("cache", "sdpa", torch.bfloat16)


def test_probe_failures_never_raise(monkeypatch):
    """Whatever the build raises (a read-only cache folder: PermissionError), bf16 keeps SDPA."""
    from dice_fast.ops import native

    def refuse(*a, **k):
        raise PermissionError("[Errno 13] Permission denied: '/root/.cache/dice_fast'")

    monkeypatch.setattr(tuning, "_AMX", {})
    monkeypatch.setattr(tuning, "has_amx_bf16", lambda: True)
    monkeypatch.setattr(native, "build", refuse)
    ok, why = tuning.amx_kernel()
    assert not ok and "PermissionError" in why


def _spy_amx(monkeypatch) -> list:
    """The answers of `cpu_attention.amx_applies` from here on (True: the kernel ran that run)."""
    answers, real = [], tuning.amx_applies
    monkeypatch.setattr(tuning, "amx_applies", lambda *a, **k: answers.append(real(*a, **k)) or answers[-1])
    return answers


@pytest.mark.parametrize("head_dim", [32, 64])
def test_bf16_engine_with_the_kernel_within_plain_model_error(amx, monkeypatch, head_dim):
    """The whole bf16 engine, its attention forced to the AMX kernel, against the float64 per-chunk oracle:
    within twice the plain bf16 per-chunk model's own error (test_gpu.py's bound)."""
    monkeypatch.setenv(tuning.ENV_KERNEL, "amx")
    ran = _spy_amx(monkeypatch)
    # the shared tiny BERT's heads are 8 wide, not the kernel's
    model, tok, prefix, suffix, first = tiny("bert", hidden_size=2 * head_dim, num_attention_heads=2,
                                             intermediate_size=4 * head_dim)
    texts = corpus()
    ref = dict(prefix=prefix, suffix=suffix, first_position=first, chunk_size=K, pooling="mean")
    oracle, _ = reference_encode(copy.deepcopy(model).double(), tok, texts, **ref)
    plain, _ = reference_encode(copy.deepcopy(model).bfloat16(), tok, texts, **ref)
    enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=K, max_batch_tokens=40, dtype="bfloat16")
    got = enc.encode_documents(texts)
    assert True in ran and "cpu_attention=bf16 amx" in repr(enc)  # the kernel really ran
    assert_within_plain_error(got, plain, oracle, torch.bfloat16, what=f"bf16 engine, AMX attention, d={head_dim}")


def test_bundled_model_same_vectors_either_kernel(amx, monkeypatch):
    """The bundled MiniLM (heads of 32) on real prose: the engine's bf16 vectors with the AMX kernel and
    with torch's SDPA agree to bf16 noise (measured: cos min 0.99997 over 500 texts, RESULTS §20)."""
    from dice_fast.models import default_model_path
    from dice_fast.quant import held_out_texts

    enc = DiceEncoder.from_pretrained(device="cpu", dtype="bfloat16")
    texts = held_out_texts(enc.tokenizer, 24, 254)
    got, ran = {}, _spy_amx(monkeypatch)
    for kernel in ("sdpa", "amx"):
        monkeypatch.setenv(tuning.ENV_KERNEL, kernel)
        got[kernel] = np.asarray(enc.encode_documents(texts), dtype=np.float64)
    assert True in ran
    cos = (got["sdpa"] * got["amx"]).sum(1) / np.linalg.norm(got["sdpa"], axis=1) / np.linalg.norm(got["amx"], axis=1)
    assert cos.min() >= 0.9995, cos.min()
    assert default_model_path()  # the bundled model, not a hub download
