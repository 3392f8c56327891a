"""Out-of-memory faults offline, injected through the model itself (a forward pre-hook raising
``torch.OutOfMemoryError``): batches are split and retried down to one chunk with every vector equal
to an uninjected run, the batch budget halves and recovers, and a chunk that fails alone raises an
error naming its document."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder, faults
from dice_fast.faults import InputOutOfMemory, is_out_of_memory, rows_of, run_split
from fault_injection import failing_forward, has_poison, poisoned
from helpers import assert_close
from tiny_models import WORDS, tiny


def texts_of(n: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


@pytest.fixture(scope="module")
def encoder():
    """A tiny random BERT: 16-token chunks (18 with [CLS]/[SEP]), 128-token batches."""
    model, tokenizer, *_ = tiny("bert")
    return DiceEncoder(model, tokenizer, chunk_size=16, max_batch_tokens=128)


def test_batches_over_a_size_are_split_and_every_vector_is_exact(encoder):
    texts = texts_of(6, 1, 60, seed=0)
    ref = encoder.encode_documents(texts, return_chunks=True)
    with failing_forward(encoder.model, lambda ids: ids.numel() > 40) as seen:
        got = encoder.encode_documents(texts, return_chunks=True)
    assert any(raised for _, raised in seen) and max(n for n, raised in seen if not raised) <= 40
    assert_close(got.documents, ref.documents, atol=1e-5, what="documents")
    assert_close(got.chunks, ref.chunks, atol=1e-5, what="chunks")


def test_budget_halves_on_out_of_memory_and_recovers(encoder, monkeypatch):
    monkeypatch.setattr(faults, "RECOVER_AFTER", 2)  # 8 by default: the same rule, in fewer batches
    texts = texts_of(2, 256, 256, seed=1)  # 16 chunks of 18 tokens each
    ref = encoder.encode_documents(texts)
    limit = [40]  # forwards over this many tokens run out of memory
    queue = encoder.chunk_queue()
    job = queue.submit(encoder.plan(texts))
    budgets = []
    with failing_forward(encoder.model, lambda ids: ids.numel() > limit[0]):
        while (batch := queue.next_batch()) is not None:
            if len(budgets) == 5:
                limit[0] = 10**9  # the memory is back
            assert batch.packed.n_tokens <= max(queue.budget, 18)
            queue.run(batch, encoder.run_batch)
            budgets.append(queue.budget)
    # 126 tokens ran out (halved), then 54 (halved); two clean batches of one chunk double it; 54 tokens
    # run out again (halved); from then on nothing runs out: it doubles back after every two batches
    assert budgets[:9] == [64, 32, 32, 64, 32, 32, 64, 64, 128], budgets
    assert set(budgets[9:]) == {128}
    assert_close(job.documents, ref, atol=1e-5)


def test_a_chunk_failing_alone_fails_only_its_job(encoder):
    a, b = texts_of(4, 5, 40, seed=2), texts_of(5, 5, 40, seed=3)
    a[2] = poisoned(a[2])
    queue = encoder.chunk_queue()
    job_a, job_b = queue.submit(encoder.plan(a)), queue.submit(encoder.plan(b))
    failed = []
    with failing_forward(encoder.model, has_poison) as seen:
        while (batch := queue.next_batch()) is not None:
            failed += queue.run(batch, encoder.run_batch)[1]
    assert [n for n, raised in seen if raised][0] > 18, "the poisoned chunk never shared a batch"
    assert failed == [job_a] and not job_a.done and job_b.done
    err = job_a.error
    assert isinstance(err, InputOutOfMemory) and err.index == 2 and err.name == "input[2]"
    assert "out of memory" in str(err) and "input[2]" in str(err) and "CUDA out of memory" in str(err)
    assert_close(job_b.documents, encoder.encode_documents(b), atol=1e-5)
    assert queue.tokens_waiting == 0 and queue.budget < encoder.max_batch_tokens


def test_a_chunk_failing_alone_never_shifts_the_cache(encoder, tmp_path):
    """The persistent cache gets every vector of a batch with a chunk that failed alone except that
    chunk's, each under its own key: a later run served from the cache equals an uncached run."""
    a, b = texts_of(4, 5, 40, seed=2), texts_of(5, 5, 40, seed=3)
    a[0] = poisoned(a[0])  # its first chunk fails early in the first batch: every later row would shift
    cached = DiceEncoder(encoder.model, encoder.tokenizer, chunk_size=16, max_batch_tokens=128, cache=tmp_path)
    queue = cached.chunk_queue()
    job_a, job_b = queue.submit(cached.plan(a)), queue.submit(cached.plan(b))
    with failing_forward(cached.model, has_poison) as seen:
        while (batch := queue.next_batch()) is not None:
            queue.run(batch, cached.run_batch)
    queue.flush()
    assert [n for n, raised in seen if raised][0] > 18 and job_a.error is not None and job_b.done
    ref = encoder.encode_documents(a[1:] + b)
    again = DiceEncoder(encoder.model, encoder.tokenizer, chunk_size=16, max_batch_tokens=128, cache=tmp_path)
    assert_close(again.encode_documents(a[1:] + b), ref, atol=1e-5)
    assert again.chunk_stats.snapshot()["disk_hits"] > 0


def test_encode_documents_names_the_document_and_streams_exact_windows(encoder):
    small = DiceEncoder(encoder.model, encoder.tokenizer, chunk_size=16, max_batch_tokens=16)  # 1 kB windows
    texts = texts_of(10, 25, 35, seed=4)  # ~1.5 kB: two streaming windows
    texts[9] = poisoned(texts[9])
    ref = encoder.encode_documents(texts[:9])
    blocks = []
    with failing_forward(small.model, has_poison):
        with pytest.raises(InputOutOfMemory, match=r"out of memory encoding documents\[9\]") as info:
            for block in small.stream_documents(texts):
                blocks.append(block)
        with pytest.raises(InputOutOfMemory, match=r"queries\[1\]"):
            small.encode_queries([texts[0], texts[9]])
    assert info.value.index == 9 and info.value.tokens == 18
    assert blocks, "the window before the failing document was not streamed"
    got = np.concatenate(blocks)
    assert_close(got, ref[: len(got)], atol=1e-5)


def test_other_errors_propagate_and_allocator_errors_count(encoder):
    with failing_forward(encoder.model, lambda ids: True, error=lambda: ValueError("not memory")):
        with pytest.raises(ValueError, match="not memory"):
            encoder.encode_documents(["the cat sat"])
    cpu = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 9663676416 bytes."
    assert is_out_of_memory(RuntimeError(cpu)) and is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("could not create a primitive"))  # oneDNN under ulimit -v
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("out of memory"))
    texts = texts_of(3, 10, 40, seed=5)
    ref = encoder.encode_documents(texts)
    with failing_forward(encoder.model, lambda ids: ids.numel() > 20, error=lambda: RuntimeError(cpu)):
        assert_close(encoder.encode_documents(texts), ref, atol=1e-5)


def test_run_split_keeps_packing_order(encoder):
    queue = encoder.chunk_queue()
    queue.submit(encoder.plan(texts_of(6, 5, 40, seed=6)))
    batch = queue.next_batch()
    whole = encoder.run_batch(batch.packed)
    n = len(batch.packed.lengths)
    halves = torch.cat([encoder.run_batch(rows_of(batch.packed, 0, n // 2)),
                        encoder.run_batch(rows_of(batch.packed, n // 2, n))])
    assert_close(halves.numpy(), whole.numpy(), atol=1e-5)
    calls = []

    def flaky(packed):
        calls.append(len(packed.lengths))
        if len(packed.lengths) > 1:
            raise torch.OutOfMemoryError("injected")
        return encoder.run_batch(packed)

    vectors, failed = run_split(flaky, batch.packed, encoder.dim)
    assert not failed and calls.count(1) == n
    assert_close(vectors.numpy(), whole.numpy(), atol=1e-5)
