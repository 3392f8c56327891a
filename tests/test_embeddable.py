"""An engine other programs can embed: exact on every architecture (packed or on the padded
fallback), safe to call from many threads, leaving the caller's model working as before, streaming
any iterable."""

from __future__ import annotations

import concurrent.futures
import random
import threading

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from helpers import assert_close
from oracle import K, check, corpus, text_of
from tiny_models import FALLBACK_ARCHS, WINDOWED_ARCHS, tiny


# ---------------------------------------------------------------------------------------------
# every architecture is exact: the ones that cannot run packed go through the padded fallback
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(FALLBACK_ARCHS))
def test_fallback_architectures_match_per_chunk_reference(arch):
    enc, _ = check(arch, pooling="mean")
    if arch in WINDOWED_ARCHS:  # packed, the window banded inside chunks longer than it
        assert enc.backend == "sdpa_groups" and enc.runner.packed_limit is None and enc.runner.uses_packed(10**6)
    else:
        assert enc.backend == "padded" and enc.runner.fallback_reason
    assert enc.backend.split()[0] in repr(enc)


@pytest.mark.parametrize("arch", sorted(FALLBACK_ARCHS))
@pytest.mark.parametrize("options", [dict(aggregation="max", overlap=3), dict(document_prefix="passage:", pooling="cls"),
                                     dict(max_batch_tokens=1)], ids=["max-overlap", "prefix-cls", "budget1"])
def test_fallback_architectures_with_options(arch, options):
    check(arch, **options)


@pytest.mark.parametrize("arch", WINDOWED_ARCHS)
@pytest.mark.parametrize("chunk_size", [4, 30])
def test_sliding_window_models_are_exact_within_and_beyond_the_window(arch, chunk_size):
    """Chunks shorter than the window (no band) and much longer (banded), against per-chunk forwards
    with the model's own sliding-window mask; and the band matters: full attention would differ."""
    enc, _ = check(arch, chunk_size=chunk_size, pooling="mean")
    if chunk_size == 30:
        model, *_ = tiny(arch)
        config = type(model.config)(**{**model.config.to_dict(), **{
            "modernbert": dict(local_attention=512), "mistral-swa": dict(sliding_window=None)}[arch]})
        unwindowed = type(model)(config).eval()  # same weights, window wider than any chunk
        unwindowed.load_state_dict(model.state_dict())
        ids = torch.randint(4, 40, (1, 30))
        with torch.no_grad():
            gap = (model(input_ids=ids).last_hidden_state - unwindowed(input_ids=ids).last_hidden_state).abs().max()
        assert gap > 1e-3


def test_padded_backend_can_be_forced_and_is_exact():
    enc, _ = check("bert", attention_backend="padded")
    assert enc.backend == "padded"


def test_forced_attention_mode_on_a_fallback_model_is_refused():
    model, tok, *_ = tiny("mpnet")
    with pytest.raises(ValueError, match="needs the packed path"):
        DiceEncoder(model, tok, attention="causal")


@pytest.mark.parametrize("arch,mode", [("bert", "causal"), ("llama", "bidirectional")])
def test_forced_attention_mode_with_the_padded_backend_is_refused(arch, mode):
    """attention_backend='padded' runs the model's own mask: a forced mode used to be accepted, ignored
    (vectors off by 0.2-0.3) and cached under the forced mode's key."""
    model, tok, *_ = tiny(arch)
    with pytest.raises(ValueError, match=r"needs the packed path.*attention_backend=padded"):
        DiceEncoder(model, tok, attention=mode, attention_backend="padded")


# ---------------------------------------------------------------------------------------------
# the caller's model keeps computing what it computed before
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["bert", "llama", "modernbert", "mpnet"])
def test_model_outside_the_engine_is_unchanged(arch):
    model, tok, *_ = tiny(arch)
    original = getattr(model.config, "_dice_fast_original_attn", None) or model.config._attn_implementation
    ids = torch.randint(4, 40, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    model.config._attn_implementation = original
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).last_hidden_state
    DiceEncoder(model, tok, chunk_size=K).encode_documents(corpus())
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    assert_close(after[keep], before[keep], 1e-6, what=f"{arch} after building an encoder")
    if arch == "mpnet":  # a fallback model's config is given back untouched
        assert model.config._attn_implementation == original


# ---------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------
def _interleaved(model, call_a, call_b):
    """Run ``call_a`` and ``call_b`` in two threads, provably interleaved: a forward pre-hook holds
    thread A inside its first forward until thread B has started one (B starts only once A is held),
    so all of B's forwards run in the middle of A's call. Returns (A's result, B's result)."""
    role = threading.local()
    a_held, b_ran = threading.Event(), threading.Event()

    def gate(module, args, kwargs):
        if getattr(role, "name", None) == "A" and not a_held.is_set():
            a_held.set()
            assert b_ran.wait(60), "thread B ran no forward while thread A was held inside its first one"
        elif getattr(role, "name", None) == "B":
            b_ran.set()

    def run(name, call):
        role.name = name
        return call()

    handle = model.register_forward_pre_hook(gate, with_kwargs=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(run, "A", call_a)
            assert a_held.wait(60) or a.done(), "thread A never reached a forward"
            b = pool.submit(run, "B", call_b)
            return a.result(timeout=120), b.result(timeout=120)
    finally:
        handle.remove()


def test_threads_get_exactly_the_vectors_of_sequential_calls():
    """Calls of one encoder and of a twin sharing its model, interleaved inside each other's forwards
    (with different options, batch budgets, queries, chunk outputs and a generator), give exactly
    the vectors of the same calls made one after another."""
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=40)
    twin = DiceEncoder(model, tok, chunk_size=5, aggregation="max", max_batch_tokens=23, document_prefix="passage:")
    rng = random.Random(7)
    queries = [text_of(n, rng) for n in (3, 9, 1, 30)]
    pairs = [
        (lambda: enc.encode_documents(corpus(seed=1)), lambda: twin.encode_documents(corpus(seed=3))),
        (lambda: enc.encode_documents(corpus(seed=2, longest=90)), lambda: enc.encode_queries(queries)),
        (lambda: twin.encode_documents(corpus(seed=6), return_chunks=True).documents,
         lambda: enc.encode_documents(corpus(seed=4), return_chunks=True).chunks),
        (lambda: enc.encode_documents(iter(corpus(seed=5))), lambda: twin.encode_queries(queries[::-1])),
    ]
    for i, (call_a, call_b) in enumerate(pairs):
        want = call_a(), call_b()
        got = _interleaved(model, call_a, call_b)
        for name, g, w in zip("AB", got, want):
            assert_close(g, w, 1e-6, what=f"pair {i}, thread {name}")


# ---------------------------------------------------------------------------------------------
# streaming any iterable
# ---------------------------------------------------------------------------------------------
def test_generator_input_and_stream_blocks_in_order():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=12)  # windows of ~200 characters
    rng = random.Random(11)
    texts = [text_of(rng.randint(0, 40), rng) for _ in range(60)]
    want = enc.encode_documents(texts)
    consumed = []

    def gen():
        for t in texts:
            consumed.append(t)
            yield t

    stream = enc.stream_documents(gen())
    first = next(stream)
    assert 0 < len(first) < len(texts)
    assert len(consumed) < len(texts)  # read ahead only a bounded window
    blocks = [first, *stream]
    assert len(blocks) > 2
    assert_close(np.concatenate(blocks), want, 1e-6, what="stream blocks")
    assert_close(enc.encode_documents(t for t in texts), want, 1e-6, what="generator input")
    out = enc.encode_documents(iter(texts), return_chunks=True)
    ref = enc.encode_documents(texts[:30], return_chunks=True)
    assert out.chunk_document[-1] == len(texts) - 1 and (np.diff(out.chunk_document) >= 0).all()
    n30 = int(np.searchsorted(out.chunk_document, 30))
    assert_close(out.chunks[:n30], ref.chunks, 1e-6, what="chunks across windows")


def test_input_is_read_in_the_callers_thread_and_an_abandoned_stream_closes_at_once():
    """The iterable is advanced in the caller's thread (a sqlite3 cursor may be used in its own thread
    only: the read-ahead worker raised ProgrammingError), and closing a stream whose input has paused
    no longer waits for the input: the worker only plans what the caller already read."""
    import sqlite3
    import time

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=12)  # windows of ~200 characters
    rng = random.Random(3)
    texts = [text_of(rng.randint(1, 40), rng) for _ in range(40)]
    con = sqlite3.connect(":memory:")
    con.execute("create table d (t text)")
    con.executemany("insert into d values (?)", [(t,) for t in texts])
    assert_close(enc.encode_documents(row[0] for row in con.execute("select t from d order by rowid")),
                 enc.encode_documents(texts), 1e-6, what="sqlite cursor input")
    resume = threading.Event()

    def paused():
        yield from texts
        resume.wait(30)  # the input pauses: no more text until set
        yield from texts

    stream = enc.stream_documents(paused())
    next(stream)
    t0 = time.perf_counter()
    stream.close()
    assert time.perf_counter() - t0 < 5
    resume.set()


def test_a_bad_element_comes_after_every_complete_window_before_it():
    """The input's error is raised once the windows read before it are out (the window queued when the
    error was read was dropped: 171 of 190 documents came out here)."""
    from dice_fast import engine
    from dice_fast.streaming import windows

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=12)
    rng = random.Random(5)
    texts = [text_of(rng.randint(1, 12), rng) for _ in range(200)] + [b"bad"]
    complete = 0  # documents of the windows complete before the bad element
    with pytest.raises(TypeError):
        for w, _ in windows(iter(texts), 12 * engine._WINDOW_BATCHES * engine._CHARS_PER_TOKEN,
                            engine._WINDOW_DOCUMENTS):
            complete += len(w)
    received = 0
    with pytest.raises(TypeError, match=r"documents\[200\] is bytes"):
        for block in enc.stream_documents(iter(texts)):
            received += len(block)
    assert received == complete and complete > 150


def test_stream_names_the_bad_element_by_its_global_index():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=12)
    texts = ["the cat sat on a mat"] * 50 + [b"bytes"]
    with pytest.raises(TypeError, match=r"documents\[50\] is bytes"):
        enc.encode_documents(iter(texts))
    with pytest.raises(TypeError, match="iterable of strings"):
        enc.encode_documents("one string")
    assert enc.encode_documents(iter([])).shape == (0, enc.dim)


def test_overlap_at_least_the_default_chunk_size_is_an_error():
    model, tok, *_ = tiny("bert")
    with pytest.raises(ValueError, match=r"overlap \(254\) must be smaller than the default chunk_size"):
        DiceEncoder(model, tok, overlap=254, max_length=100)
