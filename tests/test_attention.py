"""The varlen attention adapters, checked on the CPU against per-chunk SDPA.

torch's varlen_attn runs only on CUDA and its signature changed between releases (is_causal and no
scale/GQA in early ones; window_size, scale and enable_gqa later), so fakes with each signature stand
in for it here and the adapter must produce the same attention through both.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dice_fast import attention as attn
from helpers import assert_close


def _per_chunk(q, k, v, cu, causal, scale, window=(-1, -1)):
    """(T, H, D) reference: SDPA on every chunk alone, GQA by repeating kv heads; ``window``: (left,
    right) inclusive distances a query may look back / ahead (-1: unlimited), flash-attention style."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.empty_like(q)
    left, right = window
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = b - a
        allowed = torch.tensor([[(left < 0 or i - j <= left) and (right < 0 or j - i <= right) and (not causal or j <= i)
                                 for j in range(n)] for i in range(n)], dtype=torch.bool)
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           attn_mask=allowed, scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


def fake_new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), enable_gqa=False):
    assert enable_gqa or query.shape[1] == key.shape[1]
    return _per_chunk(query, key, value, cu_seq_q, False, scale, tuple(window_size))


def fake_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1)):
    """torch 2.11's signature (the GPU image's; torch/nn/attention/varlen.py at v2.11.0): window_size and
    scale, no enable_gqa (key/value must have the query's heads); causal only as window_size == (-1, 0)."""
    assert query.shape[1] == key.shape[1] == value.shape[1], "torch 2.11's varlen_attn has no GQA"
    assert isinstance(window_size, tuple), "2.11 tests window_size == (-1, 0) for causal: a list is never causal"
    return _per_chunk(query, key, value, cu_seq_q, window_size == (-1, 0), scale, window_size)


TORCH_211_SIGNATURE = ("(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, "
                       "window_size=(-1, -1))")


def fake_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    assert query.shape[1] == key.shape[1], "early releases have no GQA"
    return _per_chunk(query, key, value, cu_seq_q, is_causal, None)


def _band_window(band, causal):
    """The (left, right) window a sliding band of ``band`` tokens means (-1: unlimited)."""
    return (-1, -1) if band is None else (band, 0 if causal else band)


@pytest.mark.parametrize("fake", [fake_new, fake_211, fake_old],
                         ids=["window_size-scale-gqa", "torch2.11-window_size-scale", "is_causal-only"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("band", [None, 2])
def test_torch_varlen_adapter_matches_per_chunk_attention(monkeypatch, fake, causal, hkv, scale, band):
    attn._torch_varlen_params.cache_clear()
    monkeypatch.setattr(attn, "_torch_varlen_func", lambda: fake)
    try:
        assert attn.supports_sliding_window("torch_varlen") == (fake is not fake_old)
        if band is not None and fake is fake_old:
            return  # refused before the call (test_sliding_window_beyond_the_backend_is_refused)
        torch.manual_seed(0)
        lengths = [5, 1, 9, 3]
        cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
        q = torch.randn(sum(lengths), 4, 8)
        k, v = torch.randn(sum(lengths), hkv, 8), torch.randn(sum(lengths), hkv, 8)
        s = scale if scale is not None else 8**-0.5
        got = attn.torch_varlen(q, k, v, cu, max(lengths), causal, s, band)
        want = _per_chunk(q, k, v, cu, causal, s, _band_window(band, causal))
        assert_close(got, want, 1e-5, what="varlen adapter")
        if fake is fake_211:  # K/V heads repeated by the adapter: the same arithmetic as the reference, bit for bit
            assert torch.equal(got, want)
    finally:
        attn._torch_varlen_params.cache_clear()


def test_torch_211_stand_in_has_the_exact_signature():
    import inspect

    assert str(inspect.signature(fake_211)) == TORCH_211_SIGNATURE


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("band", [None, 3, 4, 8])
def test_sdpa_groups_matches_per_chunk_attention(causal, band):
    """band 3: every run longer than the band is masked; 4: only the 9-token run (5 = band + 1 needs
    no mask); 8: as None (no chunk longer than 9)."""
    torch.manual_seed(1)
    lengths = [9, 9, 5, 5, 5, 1]  # packed longest first, as the packer orders them
    cu = torch.tensor([0, 9, 18, 23, 28, 33, 34], dtype=torch.int32)
    q, k, v = torch.randn(34, 4, 8), torch.randn(34, 2, 8), torch.randn(34, 2, 8)
    groups = attn.length_runs(lengths, cu.tolist())
    assert groups == ((0, 2, 9), (18, 3, 5), (33, 1, 1))
    want = _per_chunk(q, k, v, cu, causal, 0.25, _band_window(band, causal))
    got = attn.groups_attention(q, k, v, groups, causal, 0.25, band)
    assert_close(got, want, 1e-5, what="sdpa_groups")
    # the traceable op of the compiled forward (a window of band + 1 tokens; padded group rows skipped)
    from dice_fast.attention_op import group_table

    op = torch.ops.dice_fast.sdpa_groups(q, k, v, group_table(groups, min_rows=5), causal, 0.25,
                                         0 if band is None else band + 1)
    assert torch.equal(op, got)
    low = attn.groups_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), groups, causal, 0.25, band)
    assert low.dtype == torch.bfloat16
    assert_close(low, want, 3e-2, what="sdpa_groups bf16")
    if band is not None and band < 8:  # the band really cut something: it differs from full attention
        assert (got - _per_chunk(q, k, v, cu, causal, 0.25)).abs().max() > 1e-2


def test_sliding_window_beyond_the_backend_is_refused(monkeypatch):
    """A chunk longer than a sliding window on a varlen_attn without window_size: a clear error, never
    full attention (the runner keeps such chunks on the padded path, so this is a guard)."""
    attn._torch_varlen_params.cache_clear()
    monkeypatch.setattr(attn, "_torch_varlen_func", lambda: fake_old)
    try:
        q = torch.randn(1, 4, 12, 8)
        cu = torch.tensor([0, 12], dtype=torch.int32)
        with attn.attention_context("torch_varlen", None), pytest.raises(ValueError, match="sliding attention window of 5"):
            attn.dice_varlen_attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu, max_length_q=12,
                                       sliding_window=5)
    finally:
        attn._torch_varlen_params.cache_clear()


def test_attention_outside_a_packed_forward_is_the_models_own():
    """Called with no packed context (the caller using its model, another thread), the registered
    function is the original implementation: here SDPA with the caller's mask."""
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[1, :, :, 3:] = False
    got, _ = attn.dice_varlen_attention(torch.nn.Module(), q, k, v, mask, scaling=0.3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3).transpose(1, 2)
    assert_close(got, want, 1e-6, what="deferred attention")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("band", [None, 127])
def test_gqa_goes_unrepeated_to_the_flash_kernel_on_meta(causal, band, monkeypatch):
    """On a varlen_attn without enable_gqa (torch 2.11: `fake_211`), GQA heads go unrepeated to
    ``aten._flash_attention_forward`` (`direct_flash_gqa`); on meta tensors its shape function runs (the
    values are compared with the repeated heads on CUDA: tests/test_gpu_pipeline.py)."""
    attn._torch_varlen_params.cache_clear()
    monkeypatch.setattr(attn, "_torch_varlen_func", lambda: fake_211)
    try:
        q = torch.empty(300, 12, 64, device="meta", dtype=torch.bfloat16)
        k = torch.empty(300, 2, 64, device="meta", dtype=torch.bfloat16)
        cu = torch.empty(4, dtype=torch.int32, device="meta")
        out = attn.torch_varlen(q, k, k.clone(), cu, 200, causal, 0.125, band)
        assert out.shape == q.shape and attn._DIRECT_GQA[0]
    finally:
        attn._torch_varlen_params.cache_clear()


def test_sdpa_groups_is_chosen_explicitly_in_float32():
    """"sdpa_groups" runs any dtype (it is the float32 default on the CPU): naming it with float32 was
    refused as if it were a flash backend (test_gpu checks those still refuse float32)."""
    assert attn.choose_backend("sdpa_groups", torch.device("cpu"), torch.float32) == "sdpa_groups"
    assert attn.choose_backend("auto", torch.device("cpu"), torch.float32) == "sdpa_groups"
