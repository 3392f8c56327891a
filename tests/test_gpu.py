"""The engine on a CUDA device: every varlen backend against the per-chunk oracle, to bf16 rounding."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from dice_fast.attention import backend_available
from reference import reference_encode
from test_engine import K, corpus
from tiny_models import tiny

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _backends():
    return [b for b in ("torch_varlen", "flash_attn", "sdpa_groups") if torch.cuda.is_available() and backend_available(b, CUDA)]


@pytest.mark.parametrize("arch", ["bert", "roberta", "llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", _backends() or ["torch_varlen"])
@pytest.mark.parametrize("pooling_impl", ["triton", "ref"])
def test_cuda_bf16_matches_reference(arch, backend, pooling_impl):
    model, tok, prefix, suffix, first = tiny(arch)
    pooling = "last" if arch == "qwen3" else "mean"
    enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=K, pooling=pooling, max_batch_tokens=40, device="cuda",
                      dtype="bfloat16", attention_backend=backend, pooling_impl=pooling_impl)
    texts = corpus()
    got = enc.encode_documents(texts)
    want, _ = reference_encode(model, tok, texts, prefix=prefix, suffix=suffix, first_position=first,
                               chunk_size=K, pooling=pooling)
    cos = (got * want).sum(1)  # unit vectors
    assert np.isfinite(got).all()
    assert cos.min() > 0.995, f"{arch}/{backend}: min cosine {cos.min():.5f} vs the fp32 per-chunk oracle"


def test_flash_backends_reject_fp32_with_a_clear_message():
    model, tok, *_ = tiny("bert")
    with pytest.raises(ValueError, match="supports only float16/bfloat16"):
        DiceEncoder(copy.deepcopy(model), tok, chunk_size=K, device="cuda", dtype="float32",
                    attention_backend="torch_varlen")
    enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=K, device="cuda", dtype="float32")
    assert enc.backend == "sdpa_groups"  # fp32 on CUDA is routed to the exact dense backend


def test_cuda_fp32_sdpa_groups_is_exact():
    model, tok, prefix, suffix, first = tiny("qwen2")
    enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=K, device="cuda", dtype="float32", max_batch_tokens=40)
    texts = corpus()
    want, _ = reference_encode(model, tok, texts, prefix=prefix, suffix=suffix, first_position=first, chunk_size=K)
    assert np.abs(enc.encode_documents(texts) - want).max() < 1e-4  # TF32 off by default for SDPA; fp32 rounding
