"""In-call dedup: identical wrapped chunks run once (the queue's registry, and its memory store across
windows), every copy gets the vector the per-chunk oracle gives, and nothing else is ever shared."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dice_fast.engine as engine
from dice_fast import DiceEncoder
from dice_fast.reuse import MemoryCache
from helpers import assert_close
from oracle import ATOL, K, check, corpus
from tiny_models import WORDS, tiny


def _counting(enc):
    """Count the chunks ``enc`` really runs."""
    real, seen = enc.run_batch, []

    def run_batch(packed):
        seen.append(len(packed.chunk_ids))
        return real(packed)

    enc.run_batch = run_batch
    return seen


def _unique_chunks(enc, texts) -> int:
    plan = enc.plan(texts)
    return len({plan.chunk_ids(c).tobytes() for c in range(plan.n_chunks) if plan.chunk_lengths[c]})


def test_identical_chunks_run_once_and_match_the_oracle():
    base = corpus(seed=3, longest=6 * K)[:7]
    block = " ".join(["alpha beta gamma delta note sun day night"] * 3)  # 3 identical K-token chunks
    texts = base + base[:4] + [block, base[2], block + " tree"]
    model, tok, *_ = tiny("bert")
    enc, got = check("bert", texts=texts)  # engine (dedup on) vs each chunk alone, float64 aggregation
    seen = _counting(enc)
    enc.encode_documents(texts)
    assert sum(seen) == _unique_chunks(enc, texts) < enc.plan(texts).n_chunks - 6
    # copies spread over many small batches and over windows
    enc2 = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=24, pooling_impl="torch")
    assert_close(enc2.encode_documents(texts), got.documents, ATOL, what="small batches")


def test_copies_in_later_windows_come_from_the_call_memory(monkeypatch):
    monkeypatch.setattr(engine, "_WINDOW_DOCUMENTS", 3)  # many windows, only two queued at a time
    model, tok, *_ = tiny("bert")
    texts = corpus(seed=4, longest=6 * K)
    texts = texts + texts[::-1]
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=40, pooling_impl="torch")
    seen = _counting(enc)
    got = enc.encode_documents(texts)
    assert sum(seen) == _unique_chunks(enc, texts)
    assert enc.chunk_stats.memory_hits > 0
    baseline = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=40, pooling_impl="torch", dedup=False)
    seen_all = _counting(baseline)  # the baseline: every chunk runs
    assert_close(got, baseline.encode_documents(texts), ATOL, what="dedup vs none")
    assert sum(seen_all) >= 2 * _unique_chunks(enc, texts) and baseline.chunk_stats.memory_hits == 0


def test_a_copy_waits_for_an_original_queued_for_a_later_batch(monkeypatch):
    """A batch that ends inside job A with budget left over goes on to job B; a copy in B whose original
    is one of A's chunks not yet handed out must wait for it (A comes first in the queue), not run too.
    Here A is 8 full chunks and a 5-token tail; the budget, 77 tokens, takes A's first 7 chunks and
    leaves 7: A's 8th (10 tokens) does not fit, the copy of A's tail (5) would."""
    monkeypatch.setattr(engine, "_WINDOW_DOCUMENTS", 1)  # one job per document, two queued at a time
    model, tok, *_ = tiny("bert")
    words = [WORDS[(7 * i + i // len(WORDS)) % len(WORDS)] for i in range(8 * K + 3)]  # no chunk repeats
    a, b = " ".join(words), " ".join(words[8 * K:])
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=7 * (K + 2) + 7, pooling_impl="torch")
    seen = _counting(enc)
    got = enc.encode_documents([a, b])
    assert _unique_chunks(enc, [a, b]) == 9 and sum(seen) == 9, seen
    assert enc.chunk_stats.deduplicated == 1
    alone = DiceEncoder(model, tok, chunk_size=K, pooling_impl="torch")
    assert_close(got, np.concatenate([alone.encode_documents([a]), alone.encode_documents([b])]), ATOL)


def test_global_positions_and_wrapping_are_part_of_a_chunks_identity():
    # the same K tokens twice in one document: one forward with local positions, two with global ones
    twice = " ".join(["the cat sat on a mat and dog"] * 2)
    texts = [twice, twice + " red house"]
    for positions, runs in (("local", 2), ("global", 3)):
        enc, _ = check("bert", texts=texts, positions=positions)
        seen = _counting(enc)
        enc.encode_documents(texts)
        assert sum(seen) == runs, positions
    # the same text as a document and as a query (other prefixes) in one queue: both run
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, document_prefix="passage :", query_prefix="query :",
                      pooling_impl="torch")
    queue = enc.chunk_queue()
    text = ["the cat sat"]
    jobs = [queue.submit(enc.plan(text, "documents")), queue.submit(enc.plan(text, "queries"), "mean")]
    while (batch := queue.next_batch()) is not None:
        queue.complete(batch, enc.run_batch(batch.packed))
    assert queue.stats.computed == 2 and queue.stats.deduplicated == 0
    assert_close(jobs[0].documents, enc.encode_documents(text), ATOL, what="document")
    assert_close(jobs[1].documents, enc.encode_queries(text), ATOL, what="query")
    assert not np.allclose(jobs[0].documents, jobs[1].documents)


@pytest.mark.parametrize("cancel", ["original", "copy", "original after a batch"])
def test_cancelling_either_side_of_a_copy(cancel):
    """A copy whose original's job is cancelled runs itself; a cancelled copy leaves nothing waiting."""
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=20, pooling_impl="torch")
    shared = ["alpha beta gamma delta note sun day night the cat", "red house with tree"]
    a_texts = ["old man boy girl car road city river"] + shared
    b_texts = shared[::-1] + ["water fire passage query"]
    queue = enc.chunk_queue()
    a, b = queue.submit(enc.plan(a_texts)), queue.submit(enc.plan(b_texts))
    assert queue.tokens_waiting < sum(int(j.plan.chunk_lengths.sum()) for j in (a, b))  # copies cost nothing
    if cancel == "original after a batch":
        batch = queue.next_batch()
        queue.complete(batch, enc.run_batch(batch.packed))
    victim = b if cancel == "copy" else a
    queue.cancel(victim)
    while (batch := queue.next_batch()) is not None:
        queue.complete(batch, enc.run_batch(batch.packed))
    survivor, texts = (a, a_texts) if victim is b else (b, b_texts)
    assert survivor.done and not victim.done
    assert_close(survivor.documents, enc.encode_documents(texts), ATOL, what=f"after cancelling the {cancel}")
    assert queue.reuse.waiting_originals == 0 and queue.tokens_waiting == 0  # nothing left waiting or remembered


def test_server_answers_a_request_wholly_from_memory():
    from dice_fast.serve import AsyncDiceEncoder
    from dice_fast.serve.metrics import ServerMetrics

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=16, max_batch_tokens=128, pooling_impl="torch")
    texts = corpus(seed=5, longest=6 * K)

    async def main():
        async with AsyncDiceEncoder(enc) as core:
            metrics = ServerMetrics(core)
            first = await core.embed_documents(texts)
            computed = core.chunk_stats.computed
            again = await asyncio.gather(core.embed_documents(texts), core.embed_documents(texts[:3]))
            return first, again, computed, core.chunk_stats.snapshot(), metrics.render()

    first, again, computed, stats, text = asyncio.run(main())
    want = enc.encode_documents(texts)
    for out, n in ((first, len(texts)), (again[0], len(texts)), (again[1], 3)):
        assert_close(out.vectors, want[:n], ATOL, what="served")
    assert stats["computed"] == computed and stats["memory_hits"] > 0
    assert f'dice_fast_chunks_total{{source="memory"}} {float(stats["memory_hits"])}' in text
    assert 'dice_fast_chunk_cache_lookups_total{result="hit",tier="disk"} 0.0' in text  # labels sorted by name


def test_memory_cache_is_bounded_and_least_recently_used_goes_first():
    import torch

    rows = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    from dice_fast.reuse.memory import ENTRY_OVERHEAD

    mem = MemoryCache(3 * (16 + 4 + ENTRY_OVERHEAD))  # three entries: a 4-byte identity, a 16-byte vector, bookkeeping
    for k in range(4):
        mem.put(k, bytes([k]) * 4, rows, k)
        if k == 2:
            assert mem.get(0, b"\0" * 4) is not None  # 0 is now the most recent
    assert len(mem) == 3 and mem.bytes <= mem.max_bytes
    assert mem.get(1, b"\1" * 4) is None and mem.get(0, b"\0" * 4) is not None
    assert mem.get(3, b"\4" * 4) is None  # a key match with another identity is a miss


def test_a_popular_row_does_not_keep_its_whole_batch():
    """Every hit moved a row (a view of its batch's output) to the young end: one popular row of each
    batch kept every batch alive (450 MB held under a 64 MB bound in a review's soak). A row found
    again is copied out of its batch, so the batches' tensors go with their other rows."""
    import torch

    from dice_fast.reuse.memory import ENTRY_OVERHEAD

    dim, batch = 8, 64
    mem = MemoryCache(100 * (4 * dim + 4 + ENTRY_OVERHEAD))  # 100 entries: under two batches
    for b in range(50):
        out = torch.randn(batch, dim)
        for r in range(batch):
            mem.put(b * batch + r, b"id%02d" % (r % 100), out, r)
        for popular in range(0, b * batch + 1, batch):  # the first row of every batch so far, found again
            if (got := mem.get(popular, b"id00")) is not None:
                tensor, row = got
                assert torch.equal(tensor[row], mem.get(popular, b"id00")[0][0])
    held = {item[1].untyped_storage().data_ptr(): item[1].untyped_storage().nbytes() for item in mem._items.values()}
    assert mem.bytes <= mem.max_bytes and sum(held.values()) <= 3 * batch * dim * 4, len(held)


def test_suffix_is_part_of_a_chunks_identity():
    """The same text wrapped in another special suffix (another tokenizer for the same weights:
    the namespace has no tokenizer in it; a mutation that dropped it survived the suite) must not share a cache identity or key."""
    from dice_fast.chunking import EncodingPlan, TokenizedDocuments, plan_chunks
    from dice_fast.reuse.keys import chunk_keys

    lengths = np.array([6])
    docs = TokenizedDocuments(np.arange(10, 16, dtype=np.int64), np.array([0, 6]))
    chunks = plan_chunks(lengths, 4, 0)
    pre = np.array([101])
    a = chunk_keys(EncodingPlan(docs, chunks, pre, np.array([102])))
    b = chunk_keys(EncodingPlan(docs, chunks, pre, np.zeros(0, np.int64)))
    for c in range(chunks.n_chunks):
        assert a.identity(c) != b.identity(c)
        assert a.keys[c] != b.keys[c]


@pytest.mark.parametrize("texts", [["one short document"], ["first of two", "second of two"]])
def test_returned_chunk_vectors_are_the_callers_own(texts):
    """A caller may scale the chunk vectors it gets in place: the stores that reuse them (a shared
    `MemoryCache`) keep theirs. (A batch holding every chunk of one job hands the job its vectors
    without a copy, and those are the rows the stores hold.)"""
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, pooling_impl="torch", normalize=False)
    assert not enc.settings.normalize_chunks  # the returned rows would be the pooled ones themselves
    memory = MemoryCache(1 << 20)
    want = enc.encode_documents(texts, return_chunks=True).chunks.copy()
    for _ in range(2):
        queue = enc.chunk_queue(memory=memory)
        job = queue.submit(enc.plan(texts), keep_chunks=True)
        while (batch := queue.next_batch()) is not None:
            queue.run(batch)
        np.testing.assert_array_equal(job.chunks, want)  # the second time: from the memory store
        job.chunks *= 0.0


def test_a_run_batch_that_reuses_its_output_buffer_corrupts_no_store():
    """`ChunkQueue.run` takes any ``run_batch``, and one that writes every batch into the same buffer (a
    static output, as CUDA graphs have) must not leave the memory store pointing into that buffer."""
    import torch

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, pooling_impl="torch")
    buffers = {}

    def run_batch(packed):
        out = enc.run_batch(packed)
        buf = buffers.setdefault(tuple(out.shape), torch.empty_like(out))
        return buf.copy_(out)

    memory = MemoryCache(1 << 20)
    first, other = ["the first document"], ["another document"]
    got = []
    for texts in (first, other, first):  # the third from the memory store
        queue = enc.chunk_queue(memory=memory)
        job = queue.submit(enc.plan(texts))
        while (batch := queue.next_batch()) is not None:
            queue.run(batch, run_batch)
        got.append(job.documents)
    assert queue.stats.memory_hits == 1 and queue.stats.computed == 0  # the third: from the store
    np.testing.assert_array_equal(got[2], got[0])
    assert not np.array_equal(got[1], got[0])
