"""CUDA graphs for small batches (`dice_fast.graphs`): bucket choice, the padding chunks, that
padding never changes a real chunk's vector (the padded path run eagerly on the CPU), the memory
bound on the captured graphs. The capture itself: tests/test_gpu_graphs.py (``gpu`` marker)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder, graphs
from dice_fast.bench.run import encode_plan
from dice_fast.packing import PackedBatch
from helpers import side_by_side
from tiny_models import tiny

TEXTS = ["alpha beta gamma delta " * 5, "one two three", "x y z w " * 9, "solo"]


def batch_of(lengths, first=0) -> PackedBatch:
    lengths = np.sort(np.asarray(lengths, np.int64))[::-1]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    t = int(cu[-1])
    return PackedBatch(input_ids=np.arange(t, dtype=np.int64) + 100,
                       position_ids=np.arange(t, dtype=np.int64) - np.repeat(cu[:-1], lengths) + first,
                       cu_seqlens=cu.astype(np.int32), max_seqlen=int(lengths.max()), chunk_ids=np.arange(len(lengths)),
                       lengths=lengths)


def test_buckets_and_choice():
    b = graphs.make_buckets((512, 64, 128), longest_chunk=100, shortest_chunk=3)
    assert [x.tokens for x in b] == [64, 128, 512] and [x.max_seqlen for x in b] == [64, 100, 100]
    assert [x.chunks for x in b] == [22, 43, 171]
    assert graphs.choose_bucket(b, 60, 3, 30) == b[0]
    assert graphs.choose_bucket(b, 65, 3, 30) == b[1]  # over the tokens
    assert graphs.choose_bucket(b, 60, 3, 70) == b[1]  # a chunk longer than the bucket's max_seqlen
    assert graphs.choose_bucket(b, 60, 21, 3) == b[0]  # 21 chunks + 1 dummy: the 22 slots
    assert graphs.choose_bucket(b, 60, 22, 3) == b[1]  # 22 chunks + 1 dummy > 22 slots
    assert graphs.choose_bucket(b, 513, 5, 100) is None
    assert graphs.n_dummies(0, 10) == 0 and graphs.n_dummies(10, 10) == 1 and graphs.n_dummies(11, 10) == 2
    for bad in ((), (0, 8), (8, 8)):
        with pytest.raises(ValueError, match="distinct"):
            graphs.make_buckets(bad, 10)


@pytest.mark.parametrize("lengths", [[7, 5, 5, 1], [10, 10, 10], [3]])
def test_pad_batch_appends_dummy_chunks(lengths):
    batch = batch_of(lengths, first=2)
    bucket = graphs.Bucket(tokens=64, chunks=20, max_seqlen=10)
    p = graphs.pad_batch(batch, bucket, pad_id=0, first_position=2)
    n, t = len(batch.lengths), batch.n_tokens
    assert p.n_tokens == 64 and len(p.cu_seqlens) == 21 and p.cu_seqlens.dtype == np.int32 and p.max_seqlen == 10
    np.testing.assert_array_equal(p.cu_seqlens[: n + 1], batch.cu_seqlens)  # the real chunks untouched
    np.testing.assert_array_equal(p.input_ids[:t], batch.input_ids)
    np.testing.assert_array_equal(p.position_ids[:t], batch.position_ids)
    d = graphs.n_dummies(64 - t, 10)
    dummy = p.lengths[n:n + d]
    assert dummy.sum() == 64 - t and dummy.max() <= 10 and dummy.min() >= 1 and not p.lengths[n + d:].any()
    assert (p.input_ids[t:] == 0).all() and (p.chunk_ids[n:] == -1).all()
    for s, k in zip(p.cu_seqlens[n:n + d], dummy):  # every dummy chunk restarts at the first position
        np.testing.assert_array_equal(p.position_ids[s:s + k], np.arange(k) + 2)
    with pytest.raises(ValueError, match="does not fit"):
        graphs.pad_batch(batch_of([11]), bucket, 0, 0)


@pytest.mark.parametrize("arch", ["bert", "roberta", "qwen2", "llama"])
def test_padding_never_changes_a_chunk_vector(arch):
    """The padded path (run eagerly here; the same shapes are what a graph replays) gives the
    unpadded engine's vectors; a batch over the largest bucket runs unpadded."""
    model, tok, *_ = tiny(arch)
    enc = DiceEncoder(model, tok, chunk_size=8)
    plan = enc.plan(TEXTS)
    want = encode_plan(enc, plan)
    runner = graphs.use_cuda_graphs(enc, buckets=(16, 64, 256))
    assert runner.capture is False  # CPU: padded, eager
    got = encode_plan(enc, plan)
    assert runner.replays >= 1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    small = graphs.use_cuda_graphs(enc, buckets=(8,))  # every batch is larger: unpadded, as before
    np.testing.assert_array_equal(encode_plan(enc, plan), want)
    assert small.replays == 0 and enc.runner is small


def test_chunk_vectors_of_a_padded_batch_equal_the_unpadded_ones_exactly():
    model, tok, *_ = tiny("qwen2")
    enc = DiceEncoder(model, tok, chunk_size=8)
    plan = enc.plan(TEXTS)
    from dice_fast.packing import pack

    batch = pack(plan.tokens, plan.chunks, np.arange(plan.n_chunks), np.array([], np.int64), np.array([], np.int64), 0)
    plain = enc.runner.run(batch)
    graphed = graphs.GraphedRunner(enc.runner, longest_chunk=8, buckets=(batch.n_tokens + 37,))
    torch.testing.assert_close(graphed.run(batch), plain, rtol=0, atol=1e-6)
    assert graphed.replays == 1


def test_memory_bound_drops_large_buckets():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=8)
    per_token = graphs.graph_bytes_per_token(model.config, torch.float32)
    c = model.config
    assert per_token >= 4 * (c.hidden_size + c.intermediate_size)  # at least the residual and the MLP's hidden
    assert graphs.graph_bytes_per_token(model.config, torch.bfloat16) < per_token
    buckets = graphs.make_buckets((64, 256, 1024), 10)
    kept = graphs.buckets_within(buckets, 300 * per_token, per_token)
    assert [b.tokens for b in kept] == [64, 256]
    runner = graphs.GraphedRunner(enc.runner, 10, (64, 256, 1024), memory_mb=300 * per_token / 2**20)
    assert [b.tokens for b in runner.buckets] == [64, 256]


def test_capture_needs_cuda_and_a_device_side_backend():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=8)
    with pytest.raises(ValueError, match="CUDA graphs .* need"):
        graphs.GraphedRunner(enc.runner, 10, capture=True)


def test_the_option_is_off_by_default_and_refused_without_cuda():
    model, tok, *_ = tiny("bert")
    assert not DiceEncoder(model, tok, chunk_size=8).config.cuda_graphs
    with pytest.raises(ValueError, match=r"cuda_graphs=True.*not cpu"):
        DiceEncoder(model, tok, chunk_size=8, cuda_graphs=True)


class _EmulatedGraph:
    """A captured graph on the CPU: replay runs the forward on the bucket's static inputs and writes
    its static output in place, as `torch.cuda.CUDAGraph.replay` does."""

    def __init__(self, runner, g):
        self.runner, self.g = runner, g

    def replay(self):
        g = self.g
        g.hidden.copy_(self.runner._forward(g.padded, g.ids, g.pos, g.cu))


def test_replays_from_threads_each_read_their_own_batch(monkeypatch):
    """One bucket's static buffers were loaded, replayed and read by several threads at once: a
    thread pooled another's hidden states (27 of 571 calls wrong in 3 s, found by a review); the
    runner now holds them for one thread from load to pooling."""
    load = graphs._Graph.load

    def load_keeping_the_batch(self, padded):  # the emulated replay reads its host lengths
        load(self, padded)
        self.padded = padded

    def capture(self, bucket, padded):
        g = graphs._Graph(bucket, self.runner.device)
        g.load(padded)
        g.hidden = self._forward(padded, g.ids, g.pos, g.cu).clone()
        g.graph = _EmulatedGraph(self, g)
        self._graphs[bucket] = g
        return g

    monkeypatch.setattr(graphs._Graph, "load", load_keeping_the_batch)
    monkeypatch.setattr(graphs.GraphedRunner, "_capture", capture)
    model, tok = tiny("bert")[:2]
    enc = DiceEncoder(model, tok, chunk_size=16, max_batch_tokens=512, pooling_impl="torch")
    plain = DiceEncoder(model, tok, chunk_size=16, max_batch_tokens=512, pooling_impl="torch")
    runner = graphs.use_cuda_graphs(enc, buckets=(256, 512), capture=False)
    runner.capture = True  # refused off CUDA: the emulated capture stands in
    words = TEXTS[0].split() + TEXTS[2].split()
    queries = [[" ".join(words[(i + j) % len(words):][: 2 + (i * j) % 12]) for j in range(6)] for i in range(12)]
    want = [plain.encode_queries(q) for q in queries]
    wrong = []

    def work(rng):
        i = rng.randrange(len(queries))
        if not np.allclose(enc.encode_queries(queries[i]), want[i], atol=1e-5):
            wrong.append(i)

    side_by_side([work] * 4, 2.0)
    assert not wrong and runner.replays > 50, (wrong, runner.replays)


def test_a_graphed_encoder_whose_model_another_encoder_moved_refuses_to_run():
    """Bucketed batches replay without ModelRunner.run, so its placement check never ran: the first
    encoder went on in bf16 (1.7e-3 off here; on CUDA a graph replays weights that were freed)."""
    import copy

    model, tok, *_ = tiny("bert")
    model = copy.deepcopy(model)
    first = DiceEncoder(model, tok, chunk_size=8)
    graphs.use_cuda_graphs(first, capture=False)  # the CPU stand-in of the graphed path
    first.encode_documents(["a few words of text"])
    assert first.runner.replays == 1
    DiceEncoder(model, tok, chunk_size=8, dtype="bfloat16")  # casts the shared model
    with pytest.raises(ValueError, match="weights are now bfloat16 on cpu"):
        first.encode_documents(["a few words of text"])
