"""Late chunking (strategy="late"): each window alone through the plain Hugging Face model, every
chunk the float64 mean of its own tokens' states, must equal the packed engine's chunk and document
vectors to float32 rounding; the windows tile the document and pool every chunk exactly once; reuse
never hands a DICE vector to a late chunk or the reverse."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from dice_fast.chunking import plan_chunks, plan_windows
from dice_fast.errors import OptionError
from dice_fast.faults import run_split
from helpers import assert_close
from oracle import ATOL, text_of
from reference import late_reference_encode, late_windows
from tiny_models import tiny

K = 6


def late_corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lengths = [0, 1, K - 1, K, 3 * K + 2, 40, 41, 100, 170] + [rng.randint(0, 60) for _ in range(4)]
    rng.shuffle(lengths)
    return [text_of(n, rng) for n in lengths]


def check_late(arch, texts=None, window_tokens=24, window_overlap=8, **options):
    model, tok, prefix, suffix, first = tiny(arch)
    options = {"chunk_size": K, "max_batch_tokens": 50, "pooling": "mean", "pooling_impl": "torch", **options}
    texts = late_corpus() if texts is None else texts
    enc = DiceEncoder(model, tok, strategy="late", window_tokens=window_tokens, window_overlap=window_overlap,
                      normalize_chunks=False, **options)
    out = enc.encode_documents(texts, return_chunks=True)
    capacity = window_tokens - len(prefix) - len(suffix)
    want_docs, want_chunks = late_reference_encode(
        model, tok, texts, prefix=prefix, suffix=suffix, first_position=first, chunk_size=K, capacity=capacity,
        overlap=window_overlap, aggregation=options.get("aggregation", "mean"),
        max_chunks=options.get("max_chunks_per_document"), attention=options.get("attention", "model default"))
    assert_close(out.documents, want_docs, ATOL, what=f"{arch} late documents")
    assert_close(out.chunks, np.concatenate(want_chunks), ATOL, what=f"{arch} late chunks")
    return enc, out


@pytest.mark.parametrize("arch", ["bert", "roberta", "llama", "qwen2"])
def test_late_matches_per_window_reference(arch):
    """Encoders (BERT; RoBERTa: positions from padding_idx + 1) and causal decoders (Llama, Qwen2)."""
    check_late(arch)


@pytest.mark.parametrize("options", [dict(aggregation="max"), dict(aggregation="weighted_mean"),
                                     dict(max_batch_tokens=1), dict(max_batch_tokens=10_000),
                                     dict(max_chunks_per_document=2), dict(window_overlap=0),
                                     dict(window_tokens=128, window_overlap=20), dict(attention="bidirectional")],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_late_options_match_reference(options):
    arch = "llama" if "attention" in options else "bert"
    check_late(arch, **options)


def test_spans_tile_and_every_chunk_is_pooled_once():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([[0, 1, 5, 6, 7, 30, 31], rng.integers(0, 400, 40)])
    for size, capacity, overlap in [(6, 22, 8), (6, 22, 7), (5, 5, 0), (16, 60, 30), (64, 510, 128)]:
        chunks = plan_chunks(lengths, size)
        w = plan_windows(chunks, lengths, capacity, overlap)
        assert (w.length <= capacity).all() and (w.start >= 0).all()
        assert (w.start + w.length <= lengths[w.document]).all()
        assert np.all(np.diff(w.chunk_window) >= 0), "windows follow the chunks' order"
        ends = chunks.start + chunks.length
        win = w.chunk_window
        assert (w.document[win] == chunks.document).all()
        assert (chunks.start >= w.start[win]).all() and (ends <= w.start[win] + w.length[win]).all()
        before = chunks.start - w.start[win]
        after = w.start[win] + w.length[win] - ends
        left, right = overlap - overlap // 2, overlap // 2
        assert (before >= np.minimum(left, chunks.start)).all(), "context before every chunk"
        assert (after >= np.minimum(right, lengths[chunks.document] - ends)).all(), "context after every chunk"
        for d in range(len(lengths)):  # the plain-loop reference cuts the same windows
            lo, hi = chunks.cu_doc_chunks[d], chunks.cu_doc_chunks[d + 1]
            doc_chunks = [(int(s), [0] * int(n)) for s, n in zip(chunks.start[lo:hi], chunks.length[lo:hi])]
            want = late_windows(int(lengths[d]), doc_chunks, capacity, overlap)
            got_w = np.flatnonzero(w.document == d)
            assert [(int(w.start[i]), int(w.start[i] + w.length[i])) for i in got_w] == [(a, b) for a, b, _ in want]


def test_char_spans_tile_each_document_and_chunks_equal_dice_spans():
    model, tok, *_ = tiny("bert")
    texts = late_corpus(3)
    late = DiceEncoder(model, tok, chunk_size=K, strategy="late", window_tokens=24, window_overlap=8)
    dice = DiceEncoder(model, tok, chunk_size=K)
    a, b = late.encode_documents(texts, return_chunks=True), dice.encode_documents(texts, return_chunks=True)
    for field in ("chunk_document", "chunk_start", "chunk_end", "chunk_start_char", "chunk_end_char"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    for d, text in enumerate(texts):
        rows = np.flatnonzero(a.chunk_document == d)
        assert " ".join(text[s:e] for s, e in zip(a.chunk_start_char[rows], a.chunk_end_char[rows])) == text
    assert not np.allclose(a.chunks[a.chunk_end - a.chunk_start > 1], b.chunks[a.chunk_end - a.chunk_start > 1])


def test_late_in_one_queue_beside_dice_and_single():
    """Plans of every strategy share batches (per-request strategy in the server): each gets its own vectors."""
    model, tok, *_ = tiny("bert")
    texts = late_corpus(5)
    enc = DiceEncoder(model, tok, chunk_size=K, window_tokens=24, window_overlap=8, max_batch_tokens=64)
    alone = {s: enc.encode_documents(texts) if s == "dice" else
             DiceEncoder(model, tok, chunk_size=K, window_tokens=24, window_overlap=8, strategy=s).encode_documents(texts)
             for s in ("dice", "late", "single")}
    queue = enc.chunk_queue()
    jobs = {s: queue.submit(enc.plan(texts, strategy=s)) for s in ("late", "dice", "single", )}
    jobs["late2"] = queue.submit(enc.plan(texts[::-1], strategy="late"))  # copies of queued late chunks
    while (batch := queue.next_batch()) is not None:
        queue.run(batch)
    for s in ("dice", "late", "single"):
        assert_close(jobs[s].documents, alone[s], ATOL, what=s)
    assert_close(jobs["late2"].documents[::-1], alone["late"], ATOL, what="late, deduplicated")


def test_reuse_never_mixes_dice_and_late(tmp_path):
    model, tok, *_ = tiny("bert")
    texts = late_corpus(7) + late_corpus(7)  # duplicates: deduplicated within a call
    opts = dict(chunk_size=K, window_tokens=24, window_overlap=8)
    plain = {s: DiceEncoder(model, tok, strategy=s, dedup=False, **opts).encode_documents(texts, return_chunks=True)
             for s in ("dice", "late")}
    for first, second in (("dice", "late"), ("late", "dice")):
        folder = tmp_path / first
        one = DiceEncoder(model, tok, strategy=first, cache=str(folder), **opts)
        one.encode_documents(texts)
        two = DiceEncoder(model, tok, strategy=second, cache=str(folder), **opts)
        got = two.encode_documents(texts, return_chunks=True)
        assert two.chunk_stats.disk_hits == 0, f"a {first} vector served to a {second} chunk"
        assert_close(got.chunks, plain[second].chunks, ATOL, what=f"{second} after {first} in one cache")
        again = DiceEncoder(model, tok, strategy=second, cache=str(folder), **opts)
        assert_close(again.encode_documents(texts), plain[second].documents, ATOL, what="from the cache")
        assert again.chunk_stats.disk_hits > 0
    # the keys of one text under both strategies differ
    enc = DiceEncoder(model, tok, **opts)
    q = enc.chunk_queue()
    k_dice, k_late = q.keys_for(enc.plan(texts[:3])), q.keys_for(enc.plan(texts[:3], strategy="late"))
    assert not set(k_dice.messages) & set(k_late.messages)


def test_a_window_split_by_out_of_memory_keeps_its_chunks():
    model, tok, *_ = tiny("bert")
    texts = late_corpus(9)
    enc = DiceEncoder(model, tok, chunk_size=K, strategy="late", window_tokens=24, window_overlap=8,
                      max_batch_tokens=10_000)
    queue = enc.chunk_queue(dedup=False)
    job = queue.submit(enc.plan(texts), keep_chunks=True)
    batch = queue.next_batch()
    assert batch.packed.n_chunks > len(batch.packed.lengths), "windows pool several chunks"

    def run(b):
        if len(b.lengths) > 1:
            raise torch.OutOfMemoryError("too big")
        return enc.run_batch(b)

    whole = enc.run_batch(batch.packed)
    split, failed = run_split(run, batch.packed, enc.spec.hidden_size)
    assert not failed
    assert_close(split, whole, ATOL, what="split by window vs whole")


@pytest.mark.parametrize("options,culprit", [
    (dict(pooling="cls"), "pooling"), (dict(pooling="last"), "pooling"), (dict(overlap=2), "overlap"),
    (dict(positions="global"), "positions"), (dict(window_tokens=129), "window_tokens"),
    (dict(window_tokens=7), "window_tokens"), (dict(window_overlap=19), "window_overlap"),
])
def test_late_refuses_what_it_cannot_take(options, culprit):
    model, tok, *_ = tiny("bert")
    options = {"window_tokens": 24, **options}
    with pytest.raises(OptionError, match=culprit):
        DiceEncoder(model, tok, chunk_size=K, strategy="late", **options)
    enc = DiceEncoder(model, tok, chunk_size=K, **options)  # dice takes them; a late plan is refused the same way
    with pytest.raises(OptionError, match=culprit):
        enc.plan(["a cat"], strategy="late")
    assert enc.plan(["a cat"]).windows is None


@pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="OpenVINO is not installed (the int8 extra)")
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_late_on_openvino_matches_per_window_reference(arch, ov_cache):
    """runtime='openvino' (the path dtype='auto' picks on many CPUs) pools each chunk inside its window's
    dense row; it was refused before."""
    enc, _ = check_late(arch, runtime="openvino", dtype="float32")
    assert enc.precision.startswith("float32 (openvino")


@pytest.mark.parametrize("bad", ["LATE", "", None, 3])
def test_unknown_plan_strategy(bad):
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K)
    if bad is None:
        assert enc.plan(["a cat"], strategy=None).windows is None
        return
    with pytest.raises(OptionError, match="strategy"):
        enc.plan(["a cat"], strategy=bad)
    with pytest.raises(OptionError, match="window_overlap"):
        DiceEncoder(model, tok, window_overlap=-1)
