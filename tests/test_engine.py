"""Exactness of the packed engine against the per-chunk Hugging Face oracle, on every architecture."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dice_fast import DiceEncoder
from helpers import assert_close
from oracle import CPU_POOLING_IMPLS, K, check, corpus, text_of
from tiny_models import ARCHS, tiny

@pytest.mark.parametrize("impl", CPU_POOLING_IMPLS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_architecture_matches_per_chunk_reference(arch, impl):
    check(arch, pooling_impl=impl)


@pytest.mark.parametrize("arch,kind", [("llama", "bpe"), ("qwen2", "bpe"), ("xlm-roberta", "unigram"),
                                       ("bert", "unigram")])
@pytest.mark.parametrize("prefix", ["", "passage: "])
def test_subword_tokenizers_match_reference(arch, kind, prefix):
    """Byte-level BPE and SentencePiece-style Unigram: words split into several tokens, chunks cut
    inside words, and a document prefix tokenized on its own, exactly as the oracle does."""
    check(arch, tokenizer=kind, document_prefix=prefix, pooling="mean")


@pytest.mark.parametrize("arch", ["bert", "roberta", "qwen2", "mistral"])
@pytest.mark.parametrize(
    "options",
    [
        dict(pooling="cls"),
        dict(pooling="last"),
        dict(pooling="mean"),
        dict(aggregation="weighted_mean"),
        dict(aggregation="max"),
        dict(aggregation="topk_norm", top_k=3, pooling="mean"),  # last-token norms of RMSNorm models nearly tie
        dict(aggregation="topk_norm", top_k=1, pooling="mean"),
        dict(aggregation="softmax_norm", temperature=0.5, pooling="mean"),
        dict(overlap=3),
        dict(overlap=7),
        dict(normalize=False),
        dict(normalize_chunks=True, aggregation="topk_norm", top_k=2, pooling="mean"),
        dict(max_chunks_per_document=2),
        dict(document_prefix="passage:"),
        dict(strategy="single", max_length=20),
        dict(max_batch_tokens=10_000),
        dict(max_batch_tokens=1),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_options_match_reference(arch, options):
    check(arch, **options)


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_a_prefix_whose_last_token_takes_the_texts_first_characters_matches_reference(arch):
    """"passage:" then "," is one word ":," to a word-level tokenizer: the text is tokenized alone (the
    oracle encoded the ":" twice; found by randomized differential testing)."""
    check(arch, texts=[",", ". the cat sat", "the cat", "!! on the mat"], document_prefix="passage:")


@pytest.mark.parametrize("arch", ["bert", "roberta", "qwen2"])
def test_global_positions_ablation_matches_reference(arch):
    rng = random.Random(3)
    check(arch, texts=[text_of(n, rng) for n in (0, 5, K, 9 * K + 3, 12 * K)], positions="global")


@pytest.mark.parametrize("arch,attention", [("qwen2", "bidirectional"), ("llama", "bidirectional"),
                                            ("bert", "causal"), ("llama", "causal")])
def test_attention_override_matches_reference(arch, attention):
    check(arch, attention=attention)


def test_order_and_independence_from_batch_companions():
    model, tok, *_ = tiny("bert")
    texts = corpus(seed=5)
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=37)
    crowd = enc.encode_documents(texts)
    for i in (0, 3, len(texts) - 1):
        alone = enc.encode_documents([texts[i]])
        assert_close(alone[0], crowd[i], 1e-6, what=f"document {i} alone vs in a crowd")
    shuffled = list(reversed(texts))
    assert_close(enc.encode_documents(shuffled)[::-1], crowd, 1e-6, what="reversed input order")
    big = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=100_000).encode_documents(texts)
    assert_close(big, crowd, 1e-6, what="one batch vs many")


def test_global_positions_beyond_table_is_a_clear_error():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K, positions="global")
    rng = random.Random(0)
    with pytest.raises(ValueError, match=r"document 1"):
        enc.encode_documents([text_of(4, rng), text_of(200, rng)])


@pytest.mark.parametrize("kind", ["unigram", "bpe"])
def test_a_prefix_is_followed_by_the_text_as_when_tokenized_together(kind):
    """Prefix and text get the ids of ``tok(prefix + text)`` (sentence-transformers' prompts): the prefix's
    trailing space is no token of its own ("▁", "Ġ") but the text's first word's ("Ġthe", where "the" alone
    is "the"), a text starting with a space, newline or special token keeps its "▁"; spans stay in the
    text, in one call or cut in pieces (the server). Where a token would span both ("passage:\\n" then
    "\\nthe": one newline run), that text has its own ids."""
    from tiny_models import tiny_subword

    model, tok, *_ = tiny_subword("xlm-roberta" if kind == "unigram" else "llama", kind)
    texts = ["the cat sat", " the cat", "<s> the", "\nthe", " ", "passage: x", " ".join(["the cat sat on the mat"] * 60)]
    for prefix in ("passage: ", "passage:", "passage:\n", "query:  "):
        enc = DiceEncoder(model, tok, query_prefix=prefix, document_prefix=prefix, chunk_size=K)
        for what in ("queries", "documents"):
            plan = enc.plan(texts, what)
            for i, text in enumerate(texts):
                a, b = plan.tokens.offsets[i : i + 2]
                ids = [*plan.prefix, *plan.tokens.ids[a:b], *plan.suffix]
                alone = [*plan.prefix, *tok(text, add_special_tokens=False)["input_ids"], *plan.suffix]
                crossing = kind == "unigram" and prefix == "passage:\n" and text == "\nthe"
                assert ids == (alone if crossing else tok(prefix + text)["input_ids"]), (prefix, text)
                if what == "documents":  # spans in the text: the last token ends at its end
                    assert plan.tokens.char_start[a] == 0 and plan.tokens.char_end[b - 1] == len(text)
            pieces = 300 if enc.cuts_are_exact() else None  # long texts cut in pieces
            served = enc.tokenize_bounded(texts, piece_chars=pieces, what=what, kind=what)
            np.testing.assert_array_equal(served.ids, plan.tokens.ids)
            np.testing.assert_array_equal(served.char_start, plan.tokens.char_start)
    assert not enc.tokenize([""], kind="documents").ids.size  # an empty text has no tokens (no prefix space)
