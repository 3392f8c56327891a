"""A `DiceEncoder` shared between threads: beside its caller's own use of the tokenizer it was given,
and beside other encoders built over the same tokenizer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dice_fast import DiceEncoder
from tiny_models import WORDS, tiny

BESIDE_S = 1.5  # seconds of the caller's tokenizer calls beside the encoder's


def test_a_callers_truncating_calls_on_the_same_tokenizer_never_cut_the_encoders_texts():
    """transformers sets the Rust tokenizer's truncation before each call, then encodes: a caller's
    ``tok(..., truncation=True, max_length=8)`` between those steps of the encoder's call cut its
    document to 8 tokens, silently (seen within 3 s); the encoder now tokenizes with its own copy."""
    model, tok = tiny("bert")[:2]
    enc = DiceEncoder(model, tok, chunk_size=16, pooling_impl="torch")
    doc = " ".join(WORDS * 10)
    full = len(enc.tokenize([doc], spans=False).ids)
    assert full > 100
    want = enc.encode_documents([doc])
    stop = threading.Event()

    def caller():
        while not stop.is_set():
            tok(["the cat sat on the mat " * 5], truncation=True, max_length=8)

    thread = threading.Thread(target=caller)
    thread.start()
    seen, t0 = set(), time.monotonic()
    try:
        while time.monotonic() - t0 < BESIDE_S:
            seen.add(len(enc.tokenize([doc], spans=False).ids))
        got = enc.encode_documents([doc])
    finally:
        stop.set()
        thread.join(10)
    assert seen == {full}
    np.testing.assert_array_equal(got, want)
    assert tok(doc, add_special_tokens=False)["input_ids"] == enc.tokenize([doc], spans=False).ids.tolist()


def test_encoders_built_over_one_encoders_copy_share_it_and_its_lock():
    """Variants and evaluation twins pass the base encoder's copy: shared with its lock, not copied
    again (a copy per variant cost ~7 MB and ~40 ms of all-MiniLM-L6-v2's tokenizer each)."""
    from dice_fast.integrations._common import Variants

    model, tok = tiny("bert")[:2]
    base = DiceEncoder(model, tok, chunk_size=16, pooling_impl="torch")
    assert base.engine_tokenizer is not tok
    variants = Variants(base)
    first = variants.get(document_prefix="first: ")
    assert first.engine_tokenizer is base.engine_tokenizer and first._tokenizer_lock is base._tokenizer_lock
    for i in range(Variants.MAX_VARIANTS + 5):  # a prompt per call: the variants used last are kept
        variants.get(document_prefix=f"prompt {i}: ")
    assert len(variants._cache) == Variants.MAX_VARIANTS and variants.get(document_prefix="first: ") is not first


def test_prefetch_prepares_the_first_item_here_and_the_next_in_its_worker():
    """`Prefetch`: the caller waits for the first item anyway, so it is prepared in the caller's thread and a
    one-item input (one query) starts no thread; each later item is prepared in the worker while the caller
    works on the one before. Errors (the iterator's, a prepare's) come from the `next` call of their item."""
    from dice_fast.streaming import Prefetch

    where = []

    def prepare(item):
        where.append(threading.current_thread().name)
        if item == "bad":
            raise ValueError("bad item")
        return item.upper()

    with Prefetch(iter(["one"]), prepare) as ahead:
        assert ahead.pool is None and ahead.next() == "ONE" and ahead.next() is None
    assert where == [threading.current_thread().name]
    where.clear()
    with Prefetch(iter(["a", "bad", "c"]), prepare) as ahead:
        assert ahead.next() == "A"
        with pytest.raises(ValueError, match="bad item"):
            ahead.next()
    assert where[0] == threading.current_thread().name and all(w.startswith("dice_fast-prefetch") for w in where[1:])

    def failing():
        yield "x"
        raise OSError("input gone")

    with Prefetch(failing(), prepare) as ahead:
        assert ahead.next() == "X"
        with pytest.raises(OSError, match="input gone"):
            ahead.next()
    with Prefetch(iter([]), prepare) as ahead:
        assert ahead.next() is None
