"""The chunk plan and the packer against plain Python loops."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import pytest

from dice_fast.chunk_queue import ChunkQueue
from dice_fast.chunking import check_texts, plan_chunks
from dice_fast.packing import pack
from dice_fast.chunking import EncodingPlan, TokenizedDocuments
from reference import chunk_token_lists


@pytest.mark.parametrize("k,o", [(1, 0), (4, 0), (4, 1), (4, 3), (7, 2), (16, 0)])
@pytest.mark.parametrize("cap", [None, 1, 3])
def test_plan_matches_python_loop(k, o, cap):
    rng = np.random.default_rng(k * 10 + o)
    lengths = np.array([0, 1, k - 1, k, k + 1, 2 * k, 5 * k + 3] + list(rng.integers(0, 60, 20)))
    lengths = lengths[lengths >= 0]
    plan = plan_chunks(lengths, k, o, cap)
    want = []
    for d, n in enumerate(lengths):
        for start, content in chunk_token_lists(list(range(n)), k, o, cap):
            want.append((d, start, len(content)))
    got = list(zip(plan.document.tolist(), plan.start.tolist(), plan.length.tolist()))
    assert got == want
    assert plan.cu_doc_chunks[0] == 0 and plan.cu_doc_chunks[-1] == plan.n_chunks
    assert (np.diff(plan.cu_doc_chunks) >= 1).all()


def test_plan_rejects_bad_overlap():
    with pytest.raises(ValueError, match="overlap"):
        plan_chunks(np.array([5]), 4, 4)


def test_batches_respect_budget_and_order():
    """ChunkQueue hands chunks out in order under the budget (a chunk over it alone) and runs no
    zero-length chunk."""
    lengths = np.array([5, 0, 3, 9, 2, 2, 20, 1])
    docs = TokenizedDocuments(np.arange(int(lengths.sum())), np.concatenate([[0], np.cumsum(lengths)]))
    plan = EncodingPlan(docs, plan_chunks(lengths, 100), np.zeros(0, np.int64), np.zeros(0, np.int64))
    settings = SimpleNamespace(max_batch_tokens=10, spec=SimpleNamespace(first_position=0, hidden_size=4),
                               config=SimpleNamespace(aggregation="mean"), device=torch.device("cpu"), dim=4, chunk_dim=4)
    queue = ChunkQueue(settings)  # the queue reads only its settings to hand batches out
    queue.submit(plan)
    batches = []
    while (batch := queue.next_batch()) is not None:
        batches.append(np.sort(batch.packed.chunk_ids))
    flat = np.concatenate(batches)
    assert flat.tolist() == [0, 2, 3, 4, 5, 6, 7]  # in order, zero-length chunk skipped
    for b in batches:
        assert lengths[b].sum() <= 10 or len(b) == 1


def test_pack_wraps_positions_and_cu_seqlens():
    ids = np.arange(100, 130, dtype=np.int64)
    docs = TokenizedDocuments(ids, np.array([0, 10, 10, 30]))
    plan = plan_chunks(docs.lengths, 4, 0)
    chunk_ids = np.arange(plan.n_chunks)
    batch = pack(docs, plan, chunk_ids, np.array([1]), np.array([2]), first_position=2)
    assert batch.cu_seqlens.dtype == np.int32 and batch.cu_seqlens[0] == 0
    assert batch.max_seqlen == 6 and batch.n_tokens == int((plan.length + 2).sum())
    assert (np.diff(batch.lengths) <= 0).all()  # longest first
    for i, c in enumerate(batch.chunk_ids):
        lo, hi = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
        d, s, n = plan.document[c], plan.start[c], plan.length[c]
        content = ids[docs.offsets[d] + s : docs.offsets[d] + s + n]
        assert batch.input_ids[lo:hi].tolist() == [1, *content.tolist(), 2]
        assert batch.position_ids[lo:hi].tolist() == list(range(2, 2 + n + 2))
    glob = pack(docs, plan, chunk_ids, np.array([1]), np.array([2]), first_position=0, global_positions=True)
    for i, c in enumerate(glob.chunk_ids):
        lo = glob.cu_seqlens[i]
        assert glob.position_ids[lo] == plan.start[c]


def test_check_texts():
    assert check_texts(("a", "b")) == ["a", "b"]
    with pytest.raises(TypeError, match=r"documents\[1\] is bytes"):
        check_texts(["a", b"b"])
    with pytest.raises(TypeError, match="sequence of strings"):
        check_texts(5)


def test_pack_wraps_with_multi_token_prefix_and_suffix():
    """Every prefix and suffix token in order (a one-token suffix cannot tell index 0 from -1)."""
    ids = np.arange(100, 130, dtype=np.int64)
    docs = TokenizedDocuments(ids, np.array([0, 10, 10, 30]))
    plan = plan_chunks(docs.lengths, 4, 1)
    pre, suf = np.array([1, 3]), np.array([2, 4, 6])
    batch = pack(docs, plan, np.arange(plan.n_chunks), pre, suf, first_position=0)
    for i, c in enumerate(batch.chunk_ids):
        lo, hi = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
        d, s, n = plan.document[c], plan.start[c], plan.length[c]
        content = ids[docs.offsets[d] + s : docs.offsets[d] + s + n].tolist()
        assert batch.input_ids[lo:hi].tolist() == [1, 3, *content, 2, 4, 6]
