"""On CUDA (``gpu`` marker; skipped elsewhere): the producer pipeline's batches and vectors are the serial
loop's, bit for bit, from pinned staging buffers; GQA heads unrepeated through torch's flash kernel give
the repeated heads' attention; the compiled varlen forward traces in one graph and matches eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from dice_fast.attention import backend_available
from oracle import K, corpus
from tiny_models import tiny

pytestmark = pytest.mark.gpu


def _encoder(arch="bert", **options):
    import copy

    model, tok, *_ = tiny(arch)
    model = copy.deepcopy(model).to("cuda", torch.bfloat16)
    return DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=64, device="cuda", dtype="bfloat16", **options)


def test_pipeline_on_cuda_is_the_serial_loop_bit_for_bit():
    texts = corpus(seed=7, longest=9 * K)
    serial, piped = _encoder(pipeline="off"), _encoder(pipeline="on")
    assert piped.settings.pipeline and _encoder().settings.pipeline  # auto: on for CUDA
    np.testing.assert_array_equal(piped.encode_documents(texts + texts), serial.encode_documents(texts + texts))


def test_staging_is_pinned_and_one_copy_per_batch():
    from dice_fast.pipeline import Staging

    from test_pipeline import _packed

    staging = Staging("cuda")
    assert staging.pinned
    packed = _packed(5000, [2500, 2000, 500])
    s = staging.stage(packed)
    torch.cuda.synchronize()
    assert s.input_ids.is_cuda and staging.copies == 1
    np.testing.assert_array_equal(s.input_ids.cpu().numpy(), packed.input_ids)
    np.testing.assert_array_equal(s.cu_seqlens.cpu().numpy(), packed.cu_seqlens)


@pytest.mark.skipif(not backend_available("torch_varlen", torch.device("cuda")) if torch.cuda.is_available() else True,
                    reason="needs torch's varlen_attn on CUDA")
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_unrepeated_equals_repeated_on_the_flash_kernel(causal):
    from dice_fast import attention as attn

    torch.manual_seed(0)
    lengths = [300, 17, 1, 130]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths), 12, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got = attn.direct_flash_gqa(q, k, v, cu, max(lengths), causal, 0.125)
    assert got is not None, "aten._flash_attention_forward refused unrepeated K/V"
    want = attn.direct_flash_gqa(q, k.repeat_interleave(6, 1), v.repeat_interleave(6, 1), cu, max(lengths), causal, 0.125)
    assert (got.float() - want.float()).abs().max().item() < 1e-2


@pytest.mark.parametrize("arch", ["qwen2"])  # GQA, causal: the decoder path (BERT's is the modes step's)
def test_compiled_varlen_forward_traces_and_matches_eager(arch, monkeypatch):
    """The graph inductor gets (aot_eager: no code generation, the GPU check's modes step times inductor)."""
    from torch._dynamo.utils import counters

    import dice_fast.compiled as compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    texts = corpus(seed=8, longest=6 * K)
    eager, comp = _encoder(arch), _encoder(arch, compile="on")
    assert comp.runner.compiled is not None and comp.backend in ("flash_attn", "torch_varlen")
    got, want = comp.encode_documents(texts), eager.encode_documents(texts)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert float(np.min(np.sum(got * want, axis=1))) > 0.999
