"""Character spans of chunks: ``text[chunk_start_char:chunk_end_char]`` of its own document, tiling the
document in order, for every tokenizer family (word-level, the bundled WordPiece, byte-level BPE,
SentencePiece-style Unigram), with and without overlap and a document prefix, through the streaming
windows of `encode_documents`.

"Tile" here: with no overlap, a document's spans are in order; text before the first and after the
last, and between two consecutive spans, is `dropped` only: whitespace, or marks and controls a
normalizer strips (characters no token covers); and two
consecutive spans share at most one character (byte-level BPE may cut a multi-byte character into
tokens of two chunks); every chunk with tokens has a non-empty span.
"""

from __future__ import annotations

import functools
import random
import unicodedata

import numpy as np
import pytest

from dice_fast import DiceEncoder, engine
from dice_fast.streaming import windows
from dice_fast.chunking import TokenizedDocuments, chunk_char_spans, plan_chunks, tokenize
from tiny_models import WORDS, tiny, tiny_subword

ODD = ["héllo", "naïve", "日本語", "🙂", "x—y", "ok,", "(a)", "tab\tbed", "e\u0301"]


def _texts(seed: int = 0, n: int = 14) -> list[str]:
    rng = random.Random(seed)
    out = ["", "   ", "\n", "cat", "  the  cat\n\nsat  ", "🙂🙂🙂 héllo"]
    for _ in range(n - len(out)):
        words = [rng.choice(WORDS) if rng.random() < 0.8 else rng.choice(ODD) for _ in range(rng.randint(1, 60))]
        seps = [rng.choice([" ", " ", " ", "  ", "\n", ", "]) for _ in words]
        out.append(rng.choice(["", " ", "\n"]) + "".join(w + s for w, s in zip(words, seps)))
    return out


@functools.lru_cache(maxsize=None)
def _bundled_tokenizer():
    import transformers

    from dice_fast.models import default_model_path

    return transformers.AutoTokenizer.from_pretrained(default_model_path())


TOKENIZERS = {
    "word": lambda: tiny("bert")[1],
    "wordpiece": _bundled_tokenizer,
    "bpe": lambda: tiny_subword("llama", "bpe")[1],
    "unigram": lambda: tiny_subword("xlm-roberta", "unigram")[1],
}


def _spans(tok, texts, chunk_size, overlap=0):
    tokens = tokenize(tok, texts)
    plan = plan_chunks(tokens.lengths, chunk_size, overlap)
    start, end = chunk_char_spans(tokens, plan)
    return tokens, plan, start, end


def dropped(text: str) -> bool:
    """Only characters a tokenizer may cover with no token: whitespace, combining marks, controls."""
    return all(ch.isspace() or unicodedata.category(ch)[0] in "MC" for ch in text)


def assert_tiles(text: str, spans: list[tuple[int, int]], has_tokens: list[bool], where: str):
    assert spans, where
    for (s, e), full in zip(spans, has_tokens):
        assert 0 <= s <= e <= len(text), (where, s, e)
        assert (e > s) == full, (where, s, e, full)
    filled = [se for se, full in zip(spans, has_tokens) if full]
    if not filled:
        assert text.strip() == "" or not any(has_tokens), where
        return
    assert dropped(text[: filled[0][0]]), (where, text[: filled[0][0]])
    assert dropped(text[filled[-1][1] :]), (where, text[filled[-1][1] :])
    for (s0, e0), (s1, e1) in zip(filled, filled[1:]):
        assert s0 <= s1 and e0 <= e1, (where, (s0, e0), (s1, e1))
        assert s1 >= e0 - 1, (where, "spans overlap by more than one character", (s0, e0), (s1, e1))
        assert dropped(text[e0:s1]), (where, "a gap with text", text[e0:s1])


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
@pytest.mark.parametrize("chunk_size", [1, 3, 7])
def test_spans_tile_every_document(family, chunk_size):
    tok, texts = TOKENIZERS[family](), _texts()
    tokens, plan, start, end = _spans(tok, texts, chunk_size)
    for d, text in enumerate(texts):
        cs = range(plan.cu_doc_chunks[d], plan.cu_doc_chunks[d + 1])
        assert_tiles(text, [(int(start[c]), int(end[c])) for c in cs], [bool(plan.length[c]) for c in cs],
                     f"{family} documents[{d}]")
    # guard: most documents really are cut into several chunks
    assert (np.diff(plan.cu_doc_chunks) > 1).sum() >= len(texts) // 2


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_overlapping_spans_are_unions_of_the_stride_tiling(family):
    """chunk_size 6, overlap 3 (stride 3): chunk i covers the tokens of stride-3 tiles i and i + 1, so
    its span runs from tile i's start to tile i + 1's end (tile i's end for the last)."""
    tok, texts = TOKENIZERS[family](), _texts(1)
    _, plan, start, end = _spans(tok, texts, 6, overlap=3)
    _, tiles, tstart, tend = _spans(tok, texts, 3)
    overlapped = 0
    for d in range(len(texts)):
        cs = list(range(plan.cu_doc_chunks[d], plan.cu_doc_chunks[d + 1]))
        ts = list(range(tiles.cu_doc_chunks[d], tiles.cu_doc_chunks[d + 1]))
        for i, c in enumerate(cs):
            assert start[c] == tstart[ts[i]]
            last = ts[i + 1] if i + 1 < len(ts) else ts[i]
            assert end[c] == tend[last], (family, d, i)
        for c0, c1 in zip(cs, cs[1:]):
            assert start[c1] < end[c0]  # consecutive chunks share three tokens
            overlapped += 1
    assert overlapped > len(texts)


def test_word_level_spans_hold_exactly_the_chunk_words():
    """One token per vocabulary word: a chunk's span, split on whitespace, is its words."""
    tok = tiny("bert")[1]
    rng = random.Random(3)
    texts = ["  ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40))) + "\n" for _ in range(10)]
    for overlap in (0, 2):
        tokens, plan, start, end = _spans(tok, texts, 5, overlap)
        for c in range(plan.n_chunks):
            d, s = int(plan.document[c]), int(plan.start[c])
            assert texts[d][start[c] : end[c]].split() == texts[d].split()[s : s + int(plan.length[c])]


def test_spans_without_offsets_are_zero():
    tokens = TokenizedDocuments(np.arange(8), np.array([0, 5, 8]))
    start, end = chunk_char_spans(tokens, plan_chunks(tokens.lengths, 3))
    assert start.tolist() == end.tolist() == [0, 0, 0]


@pytest.mark.parametrize("family,arch,overlap", [("word", "bert", 0), ("word", "bert", 2), ("bpe", "llama", 2),
                                                  ("unigram", "xlm-roberta", 2)])
def test_encode_documents_returns_spans_through_streaming_windows(family, arch, overlap, monkeypatch):
    """The engine's spans (document prefix on) equal one plan's over the whole corpus, across several
    streaming windows (per-window token offsets): the prefix is in no span."""
    model, tok = (tiny(arch) if family == "word" else tiny_subword(arch, family))[:2]
    texts = _texts(2, n=12)
    monkeypatch.setattr(engine, "_WINDOW_BATCHES", 1)  # windows of 256 characters
    monkeypatch.setattr(engine, "_CHARS_PER_TOKEN", 1)
    options = dict(chunk_size=5, overlap=overlap, max_batch_tokens=256, pooling="mean", pooling_impl="torch")
    # guard: the engine's streaming windows really split the corpus (same sizing as the engine)
    assert len(list(windows(iter(texts), 256 * engine._WINDOW_BATCHES * engine._CHARS_PER_TOKEN, 10**6))) > 2
    prefixed = DiceEncoder(model, tok, document_prefix="passage: ", **options)
    want = prefixed.plan(texts).chunk_char_spans  # one plan of the whole corpus
    got = prefixed.encode_documents(texts, return_chunks=True)
    assert got.chunk_start_char.dtype == got.chunk_end_char.dtype == np.int64
    np.testing.assert_array_equal(got.chunk_start_char, want[0])
    np.testing.assert_array_equal(got.chunk_end_char, want[1])
    assert not any("passage:" in texts[d][s:e] for d, s, e in zip(got.chunk_document, *want))
