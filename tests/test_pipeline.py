"""The producer pipeline (dice_fast.pipeline) on the CPU: the batches it runs are the serial loop's,
chunk for chunk, and so the vectors, bit for bit, with every aggregation and strategy, with reuse and
dedup, with an out-of-memory split, with a cancellation and with a packing error; the staging buffer
(one buffer, views, slots used in turn, growth; pinned memory where torch has it)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch

import dice_fast.chunk_queue as chunk_queue
import dice_fast.engine as engine
from dice_fast import DiceEncoder, settings
from dice_fast.config import DiceConfig
from dice_fast.errors import OptionError
from dice_fast.packing import PackedBatch
from dice_fast.pipeline import BatchPipeline, Staging, can_pin, layout
from dice_fast.settings import default_batch_tokens
from fault_injection import failing_forward
from oracle import K, corpus
from tiny_models import tiny


class Recording(BatchPipeline):
    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Recording.made.append(self)


def _encoder(pipeline: str, **options):
    model, tok, *_ = tiny("bert")
    return DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=options.pop("max_batch_tokens", 48),
                       pooling_impl="torch", pipeline=pipeline, **options)


def _record(enc):
    """The batches ``enc`` runs: (chunk ids, input ids, staged?) of each."""
    real, seen = enc.run_batch, []

    def run_batch(packed):
        seen.append((packed.chunk_ids.tobytes(), packed.input_ids.tobytes(), packed.staged is not None))
        return real(packed)

    enc.run_batch = run_batch
    return seen


def _texts():
    base = corpus(seed=5, longest=7 * K)
    block = " ".join(["alpha beta gamma delta note sun day night"] * 2)
    return base + base[:5] + [block, block + " tree", base[1]]  # copies within and across batches


@pytest.fixture()
def recording(monkeypatch):
    Recording.made = []
    monkeypatch.setattr(engine, "BatchPipeline", Recording)
    return Recording.made


def _same_run(options, texts, recording, windows: int | None = None, monkeypatch=None, **call):
    serial, piped = _encoder("off", **options), _encoder("on", **options)
    if windows is not None:
        monkeypatch.setattr(engine, "_WINDOW_DOCUMENTS", windows)
    seen_s, seen_p = _record(serial), _record(piped)
    want = serial.encode_documents(texts, **call)
    got = piped.encode_documents(texts, **call)
    assert [s[:2] for s in seen_p] == [s[:2] for s in seen_s], "the pipeline ran other batches"
    assert recording and all(p._thread is not None and not p._thread.is_alive() for p in recording)
    return want, got, seen_p


@pytest.mark.parametrize("aggregation", ["mean", "weighted_mean", "max", "topk_norm", "softmax_norm"])
def test_vectors_and_batches_are_the_serial_loops(aggregation, recording, monkeypatch):
    want, got, seen = _same_run(dict(aggregation=aggregation), _texts(), recording, windows=4,
                                monkeypatch=monkeypatch, return_chunks=True)
    np.testing.assert_array_equal(got.documents, want.documents)
    np.testing.assert_array_equal(got.chunks, want.chunks)
    assert sum(p.early for p in recording) > 0  # batches really were prepared while others ran
    assert all(staged for *_, staged in seen)


LATE = dict(strategy="late", window_tokens=24, window_overlap=8)


@pytest.mark.parametrize("options", [dict(strategy="single"), dict(overlap=3), dict(dedup=False),
                                     dict(positions="global"), dict(max_batch_tokens=1), LATE,
                                     dict(LATE, max_batch_tokens=1), dict(LATE, dedup=False)])
def test_strategies_dedup_off_and_tiny_budgets(options, recording, monkeypatch):
    want, got, _ = _same_run(options, _texts(), recording, windows=3, monkeypatch=monkeypatch)
    np.testing.assert_array_equal(got, want)


def test_queries_and_copies_across_windows(recording, monkeypatch):
    serial, piped = _encoder("off"), _encoder("on")
    texts = _texts()
    np.testing.assert_array_equal(piped.encode_queries(texts), serial.encode_queries(texts))
    monkeypatch.setattr(engine, "_WINDOW_DOCUMENTS", 2)
    np.testing.assert_array_equal(piped.encode_documents(texts + texts), serial.encode_documents(texts + texts))
    assert piped.chunk_stats.deduplicated == serial.chunk_stats.deduplicated > 0
    assert piped.chunk_stats.computed == serial.chunk_stats.computed


def test_an_out_of_memory_split_gives_back_the_early_batch(recording):
    texts = _texts()
    serial, piped = _encoder("off"), _encoder("on")
    seen_s, seen_p = _record(serial), _record(piped)

    def too_big(ids):
        # the producer's selection of the next batch finished before the forward fails, as behind a real
        # (long) forward: on a loaded machine its thread could otherwise start only after the budget halved
        for pipeline in recording:
            pipeline._selected()
        return ids.numel() > 30

    with failing_forward(serial.model, too_big):
        want = serial.encode_documents(texts)
        got = piped.encode_documents(texts)
    np.testing.assert_array_equal(got, want)
    assert [s[:2] for s in seen_p] == [s[:2] for s in seen_s]
    assert sum(p.given_back for p in recording) > 0  # the budget halved after the batch prepared early


def _drive(queue, source, cancel_at: int, victim, run_batch):
    """Run ``source`` (the queue or a pipeline over it) to the end, cancelling ``victim`` after the
    batch numbered ``cancel_at``; returns the batches' chunk ids in order."""
    out, n = [], 0
    while (batch := source.next_batch()) is not None:
        source.run(batch, run_batch)
        out.append([(id(batch.jobs[p]), c) for p, c in zip(batch.part.tolist(), batch.packed.chunk_ids.tolist())])
        n += 1
        if n == cancel_at:
            queue.cancel(victim)
    return out


@pytest.mark.parametrize("cancel_at", [1, 2, 3])
def test_a_cancellation_drops_the_chunks_the_producer_prepared(cancel_at):
    enc = _encoder("off", max_batch_tokens=40)
    plans = [enc.plan(t) for t in (_texts()[:6], _texts()[6:11], _texts()[11:])]
    results = []
    for piped in (False, True):
        queue = enc.chunk_queue()
        jobs = [queue.submit(p) for p in plans]
        source = BatchPipeline(queue, enc.device) if piped else queue
        batches = _drive(queue, source, cancel_at, jobs[1], enc.run_batch)
        ids = {id(j): i for i, j in enumerate(jobs)}
        results.append(([[(ids[j], c) for j, c in b] for b in batches], [j.done for j in jobs],
                        [j.documents for j in jobs if j.done]))
        if piped:
            source.close()
    (b_s, done_s, docs_s), (b_p, done_p, docs_p) = results
    assert b_p == b_s and done_p == done_s == [True, False, True]
    for a, b in zip(docs_p, docs_s):
        np.testing.assert_array_equal(a, b)


def test_a_packing_error_is_raised_where_the_serial_loop_raises_it(monkeypatch):
    enc = _encoder("off", max_batch_tokens=40)
    plans = [enc.plan(t) for t in (_texts()[:6], _texts()[6:])]
    raised, real_pack = [], chunk_queue.pack_plan
    for piped in (False, True):
        queue = enc.chunk_queue()
        jobs = [queue.submit(p) for p in plans]
        def bad_pack(plan, *args, victim=jobs[1]):
            if plan.tokens is victim.plan.tokens:
                raise ValueError("bad plan")
            return real_pack(plan, *args)

        monkeypatch.setattr(chunk_queue, "pack_plan", bad_pack)
        source = BatchPipeline(queue, enc.device) if piped else queue
        n = 0
        with pytest.raises(ValueError, match="bad plan") as info:
            while (batch := source.next_batch()) is not None:
                source.run(batch, enc.run_batch)
                n += 1
        assert queue.fail_packing(info.value) == [jobs[1]]
        raised.append((n, jobs[0].done))
        if piped:
            source.close()
    assert raised[0] == raised[1]


def test_close_gives_back_a_batch_not_taken():
    enc = _encoder("off", max_batch_tokens=24)
    queue = enc.chunk_queue()
    queue.submit(enc.plan(_texts()))
    waiting = queue.tokens_waiting
    with BatchPipeline(queue, enc.device) as pipe:
        first = pipe.next_batch()
        pipe.run(first, enc.run_batch)
        pipe._selected()
        after_first = queue.tokens_waiting  # the producer has taken the next batch's chunks too
    assert after_first < waiting - first.packed.n_tokens
    assert queue.tokens_waiting == waiting - first.packed.n_tokens  # given back when closed


def _packed(n_tokens: int, lengths) -> PackedBatch:
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    assert cu[-1] == n_tokens
    rng = np.random.default_rng(n_tokens)
    return PackedBatch(input_ids=rng.integers(0, 1 << 40, n_tokens), position_ids=rng.integers(0, 512, n_tokens),
                       cu_seqlens=cu, max_seqlen=int(max(lengths, default=0)), chunk_ids=np.arange(len(lengths)),
                       lengths=np.asarray(lengths, np.int64))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_staging_one_buffer_views_slots_and_growth(device):
    staging = Staging(device)
    assert staging.pinned is (device == "cuda" and can_pin())  # never pinned without a CUDA torch
    first = _packed(7, [4, 3])
    a = staging.stage(first)
    b = staging.stage(_packed(10, [5, 5]))
    assert (a.slot, b.slot) == (0, 1) and staging.stage(_packed(0, [])).slot == 0  # slots in turn; empty batch
    big = _packed(5000, [2500, 2000, 500])
    c = staging.stage(big)  # slot 1 grows past 4096 bytes
    assert staging.capacity(1) >= layout(5000, 4)[2] and c.nbytes == layout(5000, 4)[2] == 80016
    assert [t.dtype for t in (c.input_ids, c.position_ids, c.cu_seqlens)] == [torch.int64, torch.int64, torch.int32]
    assert c.input_ids.shape == (5000,) and c.cu_seqlens.shape == (4,)
    assert staging.copies == (4 if device == "meta" else 0)  # one copy a batch off the CPU, none on it
    if device == "cpu":  # the views are the buffer itself, and hold the batch's arrays
        np.testing.assert_array_equal(c.input_ids.numpy(), big.input_ids)
        np.testing.assert_array_equal(c.position_ids.numpy(), big.position_ids)
        np.testing.assert_array_equal(c.cu_seqlens.numpy(), big.cu_seqlens)
        assert c.input_ids.untyped_storage().data_ptr() == c.cu_seqlens.untyped_storage().data_ptr()


def test_staged_views_reach_the_forward_exactly():
    enc = _encoder("off")
    queue = enc.chunk_queue()
    queue.submit(enc.plan(_texts()[:3]))
    batch = queue.next_batch()
    staged = dataclasses.replace(batch.packed, staged=Staging("cpu").stage(batch.packed))
    assert torch.equal(enc.run_batch(staged), enc.run_batch(batch.packed))


def test_the_option_and_the_cuda_budget_rule():
    with pytest.raises(OptionError, match="pipeline"):
        DiceConfig(pipeline="yes")
    assert _encoder("auto").settings.pipeline is False and _encoder("on").settings.pipeline is True
    cuda = torch.device("cuda")
    assert default_batch_tokens(torch.device("cpu"), 21e6) == 4096
    for amx, want in ((True, 8192), (False, 4096)):  # bf16 on a CPU with AMX: the larger budget
        with mock.patch.object(settings, "has_amx_bf16", lambda amx=amx: amx):
            assert default_batch_tokens(torch.device("cpu"), 21e6, torch.bfloat16) == want
            assert default_batch_tokens(torch.device("cpu"), 21e6, torch.float32) == 4096
    assert default_batch_tokens(cuda, 0.0) == 65536  # unknown FLOPs: the old default
    assert default_batch_tokens(cuda, 21.2e6) == 524288  # MiniLM-L6: capped
    assert default_batch_tokens(cuda, 170e6) == 131072  # BERT-base
    assert default_batch_tokens(cuda, 2.6e9) == 65536  # Qwen2-1.5B: the floor
    model, tok, *_ = tiny("bert")
    assert DiceEncoder(model, tok).spec.flops_per_token == 2 * sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_a_chunk_failing_alone_raises_the_same_error_and_stops_the_producer(recording):
    from dice_fast.faults import InputOutOfMemory
    from fault_injection import has_poison, poisoned

    texts = _texts()
    texts[9] = poisoned(texts[9])
    errors = []
    for mode in ("off", "on"):
        enc = _encoder(mode)
        with failing_forward(enc.model, has_poison), pytest.raises(InputOutOfMemory) as info:
            enc.encode_documents(texts)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "documents[9]" in errors[0]
    assert recording and not any(p._thread.is_alive() for p in recording)


@pytest.mark.parametrize("piped", [False, True])
def test_a_cancelled_copy_in_a_batch_given_back_frees_its_original(piped):
    """A copy fanned out into a batch the producer selected early, whose job is then cancelled: when
    the batch was given back, the copy waited again, holding its original's slot (and that batch's output
    tensor) for the queue's life. Serial and pipelined end with nothing waiting or remembered."""
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=6, max_batch_tokens=12, pooling_impl="torch")
    x, y = "the cat sat on a mat", "dog ran to big red house"
    queue = enc.chunk_queue()
    first = queue.submit(enc.plan([x + " " + y]))  # two chunks, 8 wrapped tokens each: one per batch
    copy = queue.submit(enc.plan([y]))  # a copy of the first job's second chunk
    source = BatchPipeline(queue, enc.device) if piped else queue
    ran = 0
    while (batch := source.next_batch()) is not None:
        source.run(batch, enc.run_batch)
        ran += 1
        if ran == 1:
            queue.cancel(copy)  # its client went away
    if piped:
        source.close()
    assert first.done and queue.reuse.waiting_originals == 0
