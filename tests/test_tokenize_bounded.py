"""Tokenization in bounded pieces (`dice_fast.pieces.tokenize_bounded`): the same ids as tokenizing whole
texts (gapless ones too, where the module says so), calls of bounded size, the lock held per piece only
(another thread's call gets in between), and refusal midway."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dice_fast.chunking import TextError, tokenize
from dice_fast.pieces import PIECE_CHARS, SEARCH_CHARS, cut_point, cuts_are_exact, pieces, tokenize_bounded, word_gap
from helpers import CountingLock
from tiny_models import CLS, SEP, WORDS, _subword_tokenizer, make_tokenizer


@pytest.fixture(scope="module")
def bert_tokenizer():
    from dice_fast.models import default_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


TEXT_CHARS = st.sampled_from(list("abc XYZ.,'- éß中\n\t ") + ["  ", "don't", "3.14", "🙂"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(TEXT_CHARS, max_size=60).map("".join), min_size=1, max_size=6),
       piece_chars=st.integers(1, 40))
def test_pieces_give_the_ids_of_whole_texts(bert_tokenizer, texts, piece_chars):
    whole = tokenize(bert_tokenizer, texts)
    lock = CountingLock()
    got = tokenize_bounded(bert_tokenizer, texts, lock, piece_chars=piece_chars)
    cuts = [c for t in texts for c in pieces(bert_tokenizer, t, CountingLock(), piece_chars)]
    assert all(0 < end - start <= piece_chars for start, end, _ in cuts[:-1])
    if all(exact for *_, exact in cuts):  # only a character-bound cut may differ (the module says when)
        np.testing.assert_array_equal(got.offsets, whole.offsets)
        np.testing.assert_array_equal(got.ids, whole.ids)
        np.testing.assert_array_equal(got.char_start, whole.char_start)  # spans in the text, not the piece
        np.testing.assert_array_equal(got.char_end, whole.char_end)
    assert lock.acquired <= 2 * len(cuts)  # a call per piece at most, and one per checked forced cut


def test_cut_points_fall_before_a_space_between_words():
    text = "one two  three four\tfive six"
    assert [j for j in range(len(text)) if word_gap(text, j)] == [3, 14, 24]
    assert cut_point(text, 0, 10) == 3  # the last gap within 10 characters
    assert cut_point(text, 3, 11) == 14
    assert cut_point(text, 3, 10) is None  # none within: a forced cut
    assert cut_point(text, 14, 100) == len(text)
    assert cut_point("nospacesatall" * 10, 0, 5) is None


def test_cuts_are_exact_where_they_are(bert_tokenizer):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert cuts_are_exact(bert_tokenizer)
    assert cuts_are_exact(make_tokenizer((CLS,), (SEP,)))
    # a normalizer that prepends to every call (as Llama 2's "▁") gives other ids for cut pieces
    base = Tokenizer(models.WordLevel({"[UNK]": 0, "▁": 1, "▁a": 2, "a": 3}, unk_token="[UNK]"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    assert not cuts_are_exact(PreTrainedTokenizerFast(tokenizer_object=base, unk_token="[UNK]"))


def _short_call_beside(long_call, tokenizer, lock: CountingLock, timeout: float) -> dict:
    """{"long": long_call(), "short": a short text tokenized with ``lock`` while ``long_call`` runs in
    another thread, held at the lock's ``hold_at``-th acquisition (a deadlock if the lock stayed held)}."""
    out = {}
    t = threading.Thread(target=lambda: out.update(long=long_call()))
    t.start()
    assert lock.holding.wait(timeout)
    out["short"] = tokenize_bounded(tokenizer, ["a short text"], lock)
    lock.release_hold.set()
    t.join(timeout)
    assert not t.is_alive()
    return out


def test_the_lock_is_released_between_pieces(bert_tokenizer):
    """While one thread tokenizes a long text, another thread's whole call gets in between its pieces."""
    long_text = " ".join(WORDS * 500)  # ~25k characters: many pieces of 1,000
    lock = CountingLock(hold_at=3)  # the long text's third piece waits until the short call is done
    out = _short_call_beside(lambda: tokenize_bounded(bert_tokenizer, [long_text], lock, piece_chars=1000),
                             bert_tokenizer, lock, 60)
    np.testing.assert_array_equal(out["long"].ids, tokenize(bert_tokenizer, [long_text]).ids)
    np.testing.assert_array_equal(out["short"].ids, tokenize(bert_tokenizer, ["a short text"]).ids)
    assert lock.acquired > 20


def test_check_stops_midway_and_enough_keeps_a_prefix(bert_tokenizer):
    text = " ".join(WORDS * 2000)  # ~100k characters
    seen = []

    class Over(Exception):
        pass

    def check(counts):
        seen.append(int(counts[1]))
        if counts[1] > 3000:
            raise Over

    lock = CountingLock()
    with pytest.raises(Over):
        tokenize_bounded(bert_tokenizer, ["short", text], lock, piece_chars=4000, check=check)
    assert lock.acquired < 10 and seen == sorted(seen)  # stopped after ~3000 of the text's ~20k tokens
    full = tokenize(bert_tokenizer, [text]).ids
    cut = tokenize_bounded(bert_tokenizer, [text, "x y"], CountingLock(), piece_chars=4000, enough=100)
    assert 100 < cut.lengths[0] < len(full)
    np.testing.assert_array_equal(cut.ids[: cut.lengths[0]], full[: cut.lengths[0]])
    np.testing.assert_array_equal(cut.ids[cut.lengths[0] :], tokenize(bert_tokenizer, ["x y"]).ids)


def test_a_text_that_is_not_unicode_is_named(bert_tokenizer):
    texts = ["fine", "also fine " * 10, "bad \ud800 text"]
    with pytest.raises(TextError, match=r"input\[2\] is not valid Unicode") as e:
        tokenize_bounded(bert_tokenizer, texts, CountingLock(), piece_chars=8, what="input")
    assert e.value.index == 2
    # a lone surrogate by a forced cut's check window (gapless text) is its text's, not the window's
    gapless = "ab.cd" * 6553 + "a\ud800" + "ab.cd" * 100
    with pytest.raises(TextError, match=r"input\[1\] is not valid Unicode: .* at character 32766") as e:
        tokenize_bounded(bert_tokenizer, ["ok", gapless], CountingLock(), what="input")
    assert e.value.index == 1


# ---------------------------------------------------------------------------------------------
# Text without word gaps: forced cuts, checked where they fall
def _gapless(kind: str, n: int, seed: int = 0) -> str:
    """About ``n`` characters of one family of text with no space between words."""
    rng = __import__("random").Random(seed)
    pick = {
        "prose": lambda: rng.choice(WORDS) + " ",
        "dotted": lambda: "a.",
        "cjk": lambda: rng.choice("中文字符日本語漢字。，、"),
        "emoji": lambda: rng.choice(["🙂", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "1\ufe0f\u20e3", ",", ".", "e\u0301"]),
        "url": lambda: f"https://example.com/p{rng.randrange(10**6)}?q={rng.randrange(99)}&x=y#f",
        "lines": lambda: rng.choice(WORDS) + "\n",
    }[kind]
    out, size = [], 0
    while size < n:
        out.append(pick())
        size += len(out[-1])
    return "".join(out)


@pytest.fixture(scope="module")
def tokenizers(bert_tokenizer):
    return {"wordpiece": bert_tokenizer, "byte-level bpe": _subword_tokenizer("bpe", ("<s>",), ())}


@pytest.mark.parametrize("kind", ["prose", "dotted", "cjk", "emoji", "url", "lines"])
def test_gapless_text_is_cut_where_the_ids_stay_those_of_the_whole(tokenizers, kind):
    text = _gapless(kind, 12_000, seed=len(kind))
    for name, tok in tokenizers.items():
        cuts = list(pieces(tok, text, CountingLock(), 1000))
        assert len(cuts) >= 12 and all(end - start <= 1000 for start, end, _ in cuts), name
        assert all(exact for *_, exact in cuts), (name, kind)
        whole, got = tokenize(tok, [text]), tokenize_bounded(tok, [text], CountingLock(), piece_chars=1000)
        for field in ("ids", "char_start", "char_end"):
            np.testing.assert_array_equal(getattr(got, field), getattr(whole, field), err_msg=f"{name} {kind} {field}")


def test_no_cut_splits_a_grapheme(bert_tokenizer):
    text = "👨\u200d👩\u200d👧" * 400 + "e\u0301" * 400 + "🇫🇷👍🏽" * 300  # joiners, combining marks, flags, tones
    for start, end, _ in pieces(bert_tokenizer, text, CountingLock(), 100):
        assert end == len(text) or not (text[end] in "\u200d\u0301\U0001f3fd" or text[end - 1] == "\u200d"), end


def test_a_run_with_no_agreeing_cut_is_cut_at_the_bound_and_reported(bert_tokenizer):
    """The documented difference: WordPiece makes one [UNK] of a word over 100 characters; cut, one per piece."""
    text = "abc" * 1000
    cuts = list(pieces(bert_tokenizer, text, CountingLock(), 1000))
    assert [(s, e) for s, e, _ in cuts] == [(0, 1000), (1000, 2000), (2000, 3000)]
    assert [x for *_, x in cuts] == [False, False, True]
    assert len(tokenize(bert_tokenizer, [text]).ids) == 1
    assert len(tokenize_bounded(bert_tokenizer, [text], CountingLock(), piece_chars=1000).ids) == 3


@pytest.mark.parametrize("run", ["a" + "\u0301" * 6000, "👨\u200d" * 3000])
def test_a_glued_run_longer_than_a_piece_is_cut_at_the_bound(bert_tokenizer, run):
    """Thousands of combining marks (or joined emoji) offer no cut outside a grapheme: walking back to
    the piece's start made 1-character pieces, each a ``size``-long walk (35k characters: 50 s)."""
    cuts = list(pieces(bert_tokenizer, run, CountingLock(), 1000))
    assert len(cuts) <= len(run) // 1000 + 1, len(cuts)
    assert cuts[0][1] >= 1000 - SEARCH_CHARS and not all(x for *_, x in cuts)


class _Recording:
    """A tokenizer that records the characters of every call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, batch, **kwargs):
        self.calls.append(sum(map(len, batch)))
        return self.tokenizer(batch, **kwargs)


def test_two_megabytes_of_gapless_text_go_in_bounded_calls_with_the_lock_released(bert_tokenizer):
    text = "a." * 1_000_000
    tok = _Recording(bert_tokenizer)
    lock = CountingLock(hold_at=5)  # the long text's fifth call waits until another thread's call is done
    out = _short_call_beside(lambda: tokenize_bounded(tok, [text], lock), bert_tokenizer, lock, 300)
    assert max(tok.calls) <= PIECE_CHARS and len(tok.calls) >= 2 * len(text) // PIECE_CHARS
    np.testing.assert_array_equal(out["short"].ids, tokenize(bert_tokenizer, ["a short text"]).ids)
    whole = tokenize(bert_tokenizer, [text])
    np.testing.assert_array_equal(out["long"].ids, whole.ids)
    np.testing.assert_array_equal(out["long"].char_end, whole.char_end)


def test_the_engine_tokenizes_a_huge_text_in_bounded_pieces(monkeypatch):
    """A text longer than PIECE_CHARS goes through `tokenize_bounded` (tokenized whole, one line of 50 MB
    took 8 GB of the tokenizer's memory): the same ids and spans, the prefix on its first piece only."""
    from dice_fast import DiceEncoder, engine
    from tiny_models import tiny

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=8, document_prefix="passage: ")
    texts = ["a short one", " ".join(WORDS * 40), ""]
    want = enc.plan(texts)
    used = []
    monkeypatch.setattr(engine, "PIECE_CHARS", 300)
    monkeypatch.setattr(engine, "tokenize_bounded", lambda *a, **k: used.append(k) or tokenize_bounded(*a, **k))
    got = enc.plan(texts)
    assert used and used[0]["piece_chars"] == 300 and len(texts[1]) > 3000
    for a, b in ((got.tokens.ids, want.tokens.ids), (got.tokens.char_start, want.tokens.char_start),
                 (got.tokens.char_end, want.tokens.char_end), (got.tokens.offsets, want.tokens.offsets)):
        np.testing.assert_array_equal(a, b)


def test_exact_pieces_tokenize_a_text_without_an_exact_cut_whole():
    """A Metaspace tokenizer prepends "▁" to every piece, so no forced cut of a gapless text agrees: the
    engine (``exact=True``) then tokenizes that text whole, and its ids are the whole text's; the first
    invalid text of a call is the one named."""
    unigram = _subword_tokenizer("unigram", ("<s>",), ("</s>",))
    texts = ["short text", "ab.cd" * 1000, "the cat " * 300]
    lock = CountingLock()
    whole = tokenize(unigram, texts)
    cut = tokenize_bounded(unigram, texts, lock, piece_chars=1000, exact=True)
    np.testing.assert_array_equal(cut.ids, whole.ids)
    np.testing.assert_array_equal(cut.char_start, whole.char_start)
    assert not np.array_equal(tokenize_bounded(unigram, texts, lock, piece_chars=1000).ids, whole.ids)
    with pytest.raises(TextError, match=r"docs\[6\] is not valid Unicode") as e:
        tokenize_bounded(unigram, ["ok", "bad \ud800", "x " * 800 + "\ud800"], lock, piece_chars=1000, what="docs",
                         base=5)
    assert e.value.index == 6
