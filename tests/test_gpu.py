"""The engine in low precision against the per-chunk oracle, with tolerances set by the plain model's own error.

The oracle is the plain Hugging Face model in float64 fed one chunk at a time, aggregated in
float64 (`reference.reference_encode`). The engine may not match it exactly in bfloat16 (or even
float32): instead, as flash-attention's tests do, its error must stay within ``FACTOR`` times the
error of the *plain* model run the same way as the oracle but in the engine's dtype on the engine's
device, plus the rounding of the output itself in that dtype:

    max |engine - oracle| <= FACTOR * max |plain - oracle| + max |dtype(oracle) - oracle| + ABS_FLOOR

A bug (wrong positions, a chunk attending to its neighbours, pooling in bf16) costs orders of
magnitude more than that; honest rounding differences cost about 1x (measured on the tiny models,
AMD EPYC CPU: ratios 0.64-1.58 over bert, roberta, llama, qwen2, qwen3 in float32 and bfloat16).
In float32 both errors are at rounding level (~1e-7) and their ratio is noise: ``ABS_FLOOR``
(1e-5, two orders below the smallest bug seen, and below bf16's rounding) keeps it from deciding.
Documents without tokens are zero vectors for tokenizers that add no special tokens: such a
document must be zero on both sides (a zero vector has no direction to compare by cosine).

The CPU tests run the same comparison on the CPU (float32 and bfloat16), so the assertion logic is
exercised in CI; the tests marked ``gpu`` run it on CUDA for every varlen backend.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from dice_fast.attention import backend_available
from reference import reference_encode
from test_engine import K, corpus
from tiny_models import WINDOWED_ARCHS, tiny

FACTOR = 2.0
ABS_FLOOR = 1e-5  # on unit vectors' components: float32 rounding noise is ~1e-7, bugs cost >= 1e-3
ARCHS = ["bert", "roberta", "llama", "qwen2", "qwen3"]


# --------------------------------------------------------------------------------------------
# the comparison
# --------------------------------------------------------------------------------------------
def zero_rows(x: np.ndarray) -> np.ndarray:
    """(n,) bool: rows that are exactly zero vectors."""
    return ~np.any(x != 0, axis=1)


def assert_within_plain_error(got, plain, oracle, dtype: torch.dtype, factor: float = FACTOR, what: str = "",
                              floor: float = ABS_FLOOR) -> None:
    """``got`` (engine) may miss ``oracle`` by at most ``factor`` x what ``plain`` misses it by, plus
    the rounding of ``oracle`` in ``dtype``, plus ``floor``. All (n_docs, H). Zero documents must be zero on both
    sides; NaN / inf anywhere fails."""
    got, plain, oracle = (np.asarray(a, dtype=np.float64) for a in (got, plain, oracle))
    assert got.shape == oracle.shape == plain.shape, f"{what}: shapes {got.shape}, {plain.shape}, {oracle.shape}"
    assert np.isfinite(got).all(), f"{what}: {int((~np.isfinite(got)).sum())} non-finite entries"
    z_got, z_oracle = zero_rows(got), zero_rows(oracle)
    odd = np.flatnonzero(z_got != z_oracle)
    assert not len(odd), (
        f"{what}: documents {odd.tolist()} are zero vectors on one side only "
        f"(engine zero: {z_got[odd].tolist()}, oracle zero: {z_oracle[odd].tolist()})"
    )
    err = np.abs(got - oracle)
    plain_err = float(np.abs(plain - oracle).max())
    rounding = float((torch.from_numpy(oracle).to(dtype).double() - torch.from_numpy(oracle)).abs().max())
    bound = factor * plain_err + rounding + floor
    if err.max() > bound:
        d, j = np.unravel_index(int(err.argmax()), err.shape)
        raise AssertionError(
            f"{what}: max error {err.max():.3g} vs the float64 oracle exceeds {factor} x the plain "
            f"{str(dtype).replace('torch.', '')} model's {plain_err:.3g} + rounding {rounding:.3g} + floor {floor:.0e} "
            f"= {bound:.3g} "
            f"(worst: document {d}, dim {j}: got {got[d, j]:.6g}, oracle {oracle[d, j]:.6g}, plain {plain[d, j]:.6g})"
        )


class _OnDevice(torch.nn.Module):
    """``model`` run on ``device`` for `reference_encode`, which builds its inputs on the CPU."""

    def __init__(self, model, device):
        super().__init__()
        self.model, self.config, self.target = model, model.config, torch.device(device)

    def forward(self, **inputs):
        out = self.model(**{k: v.to(self.target) for k, v in inputs.items()})
        return SimpleNamespace(last_hidden_state=out.last_hidden_state.cpu())


def compare_with_plain_model(arch: str, device: str, dtype: torch.dtype, **engine_options) -> None:
    """Engine (``dtype`` on ``device``) vs float64 oracle, bounded by the plain per-chunk model's error."""
    model, tok, prefix, suffix, first = tiny(arch)
    pooling = "last" if arch == "qwen3" else "mean"
    texts = corpus()
    ref = dict(prefix=prefix, suffix=suffix, first_position=first, chunk_size=K, pooling=pooling)
    oracle, _ = reference_encode(copy.deepcopy(model).double(), tok, texts, **ref)
    plain_model = _OnDevice(copy.deepcopy(model).to(device=device, dtype=dtype), device)
    plain, _ = reference_encode(plain_model, tok, texts, **ref)
    enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=K, pooling=pooling, max_batch_tokens=40, device=device,
                      dtype=str(dtype).replace("torch.", ""), **engine_options)  # fmt: skip
    got = enc.encode_documents(texts)
    what = f"{arch} {device} {dtype} {enc.backend}/{enc.pooling_impl}"
    assert zero_rows(oracle).sum() == (arch == "qwen2"), f"{what}: the corpus should hold one empty document"
    assert_within_plain_error(got, plain, oracle, dtype, what=what)


# --------------------------------------------------------------------------------------------
# CPU: the same comparison, so the logic above runs in CI
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
# qwen2 adds no special tokens: an empty document is zero; the windowed models' chunks exceed their window
@pytest.mark.parametrize("arch", ["bert", "qwen2", *WINDOWED_ARCHS])
def test_cpu_engine_within_plain_model_error(arch, dtype):
    compare_with_plain_model(arch, "cpu", dtype)


def test_cpu_comparison_catches_an_engine_that_differs():
    # chunks overlapping by 2 tokens where the oracle's do not: a subtle difference, far above bf16 noise
    with pytest.raises(AssertionError, match="exceeds"):
        compare_with_plain_model("bert", "cpu", torch.bfloat16, overlap=2)


def test_comparison_fails_when_it_should():
    rng = np.random.default_rng(0)
    oracle = rng.standard_normal((4, 8))
    oracle[2] = 0.0  # an empty document
    plain = oracle + 1e-3 * rng.standard_normal(oracle.shape)
    plain[2] = 0.0
    close = oracle + 1e-3 * (oracle != 0)
    assert_within_plain_error(close, plain, oracle, torch.bfloat16)  # document 2 zero on both sides: equal
    with pytest.raises(AssertionError, match="zero vectors on one side only"):
        bad = oracle.copy()
        bad[2, 0] = 1e-3
        assert_within_plain_error(bad, plain, oracle, torch.bfloat16)
    with pytest.raises(AssertionError, match="zero vectors on one side only"):
        bad = oracle.copy()
        bad[1] = 0.0
        assert_within_plain_error(bad, plain, oracle, torch.bfloat16)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_within_plain_error(oracle + 0.05 * (oracle != 0), plain, oracle, torch.bfloat16)  # far above bf16 noise
    with pytest.raises(AssertionError, match="exceeds"):
        assert_within_plain_error(close, plain, oracle, torch.float32, factor=0.1)
    # float32 at rounding level: the engine 3x the plain model's 1e-7 is noise, inside the floor; 1e-4 is not
    tiny_plain = oracle + 1e-7 * (oracle != 0)
    assert_within_plain_error(oracle + 3e-7 * (oracle != 0), tiny_plain, oracle, torch.float32)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_within_plain_error(oracle + 1e-4 * (oracle != 0), tiny_plain, oracle, torch.float32)
    with pytest.raises(AssertionError, match="non-finite"):
        bad = oracle.copy()
        bad[0, 0] = np.nan
        assert_within_plain_error(bad, plain, oracle, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------
CUDA = torch.device("cuda")


def _backends():
    return [b for b in ("torch_varlen", "flash_attn", "sdpa_groups") if torch.cuda.is_available() and backend_available(b, CUDA)]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", _backends() or ["torch_varlen"])
@pytest.mark.parametrize("pooling_impl", ["triton", "torch", "ref"])
def test_cuda_bf16_within_plain_model_error(arch, backend, pooling_impl):
    compare_with_plain_model(arch, "cuda", torch.bfloat16, attention_backend=backend, pooling_impl=pooling_impl)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", WINDOWED_ARCHS)
@pytest.mark.parametrize("backend", _backends() or ["torch_varlen"])
def test_cuda_bf16_sliding_window_within_plain_model_error(arch, backend):
    """Chunks longer than the window: banded by varlen_attn's window_size (or sent to the padded path
    by a varlen_attn without one) and by sdpa_groups' mask."""
    compare_with_plain_model(arch, "cuda", torch.bfloat16, attention_backend=backend, pooling_impl="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["bert", "qwen2"])
def test_cuda_fp32_sdpa_groups_within_plain_model_error(arch):
    compare_with_plain_model(arch, "cuda", torch.float32)  # fp32 on CUDA is routed to sdpa_groups


@pytest.mark.gpu
def test_flash_backends_reject_fp32_with_a_clear_message():
    model, tok, *_ = tiny("bert")
    with pytest.raises(ValueError, match="supports only float16/bfloat16"):
        DiceEncoder(copy.deepcopy(model), tok, chunk_size=K, device="cuda", dtype="float32",
                    attention_backend="torch_varlen")
    enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=K, device="cuda", dtype="float32")
    assert enc.backend == "sdpa_groups"  # fp32 on CUDA is routed to the exact dense backend
