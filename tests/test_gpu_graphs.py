"""On a GPU: CUDA-graph capture and replay of small batches (`dice_fast.graphs`), and a packed
decoder forward that never syncs (`dice_fast.nosync`) under ``torch.cuda.set_sync_debug_mode``.
The bucketing and padding logic is tested on the CPU in tests/test_graphs.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder, graphs
from dice_fast.attention import backend_available
from dice_fast.bench.run import encode_plan
from tiny_models import tiny

TEXTS = ["alpha beta gamma delta " * 5, "one two three", "x y z w " * 9, "solo", "a b " * 30]
pytestmark = pytest.mark.gpu


def _encoder(arch: str) -> DiceEncoder:
    if not backend_available("torch_varlen", torch.device("cuda")):
        pytest.skip("torch.nn.attention.varlen is missing")
    model, tok, *_ = tiny(arch)
    return DiceEncoder(model, tok, chunk_size=8, device="cuda", dtype="bfloat16", attention_backend="torch_varlen")


@pytest.mark.parametrize("arch", ["bert", "qwen2"])
def test_graph_replay_equals_the_eager_engine(arch):
    enc = _encoder(arch)
    plan = enc.plan(TEXTS)
    want = encode_plan(enc, plan)
    runner = graphs.use_cuda_graphs(enc, buckets=(64, 256))
    first = encode_plan(enc, plan)  # captures
    again = encode_plan(enc, plan)  # replays
    assert runner.capture and runner._graphs and runner.replays >= 2
    np.testing.assert_array_equal(first, again)
    cos = np.sum(first * want, axis=1)
    assert cos.min() > 0.999, f"graphed vs eager engine: min cosine {cos.min()}"  # bf16, other GEMM shapes


def test_graphs_capture_while_the_producer_stages_the_next_batch():
    """`encode_documents` with CUDA graphs and the producer pipeline (both on): buckets are captured while
    the producer thread stages the next batch (an event wait, allocations), which the capture's "global"
    error mode made fail; the vectors are the eager pipeline's."""
    if not backend_available("torch_varlen", torch.device("cuda")):
        pytest.skip("torch.nn.attention.varlen is missing")
    model, tok, *_ = tiny("bert")
    options = dict(chunk_size=8, device="cuda", dtype="bfloat16", attention_backend="torch_varlen",
                   max_batch_tokens=48, pipeline="on")
    want = DiceEncoder(model, tok, **options).encode_documents(TEXTS * 8)
    enc = DiceEncoder(model, tok, cuda_graphs=True, **options)
    got = enc.encode_documents(TEXTS * 8)
    assert enc.runner._graphs and enc.runner.replays > 0
    assert np.sum(got * want, axis=1).min() > 0.999  # bf16, padded GEMM shapes


def test_graph_memory_cap_sends_large_buckets_to_the_eager_path():
    enc = _encoder("bert")
    runner = graphs.use_cuda_graphs(enc, buckets=(64, 256), memory_mb=1e-3)
    assert runner.buckets == ()  # no bucket's estimated working set fits 1 kB
    np.testing.assert_array_equal(encode_plan(enc, enc.plan(TEXTS)), encode_plan(enc, enc.plan(TEXTS)))
    assert runner.replays == 0


@pytest.mark.parametrize("arch", ["qwen2", "llama", "bert"])
def test_packed_forward_never_syncs_on_cuda(arch):
    enc = _encoder(arch)
    plan = enc.plan(TEXTS)
    encode_plan(enc, plan)  # warm-up: lazy initialisation may sync once
    inner = enc.runner._packed_hidden

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return inner(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    enc.runner._packed_hidden = strict
    encode_plan(enc, plan)
