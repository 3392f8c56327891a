"""Exactness of the packed engine against the per-chunk Hugging Face oracle, on every architecture."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from helpers import assert_close
from reference import reference_encode
from tiny_models import ARCHS, WORDS, tiny

ATOL = 1e-5  # float32 on CPU, against float64 aggregation of float32 per-chunk forwards
K = 8
def text_of(n_tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_tokens))


def corpus(seed: int = 0, longest: int = 30 * K) -> list[str]:
    rng = random.Random(seed)
    lengths = [0, 1, K, K + 1, 2 * K, 3 * K - 1, longest] + [rng.randint(0, 5 * K) for _ in range(5)]
    rng.shuffle(lengths)
    return [text_of(n, rng) for n in lengths]


def default_pooling(arch: str) -> str:
    return "last" if arch in ("mistral", "qwen3") else "mean"


def check(arch, texts=None, **options):
    model, tok, prefix, suffix, first = tiny(arch)
    options.setdefault("chunk_size", K)
    options.setdefault("pooling", default_pooling(arch))
    options.setdefault("max_batch_tokens", 40)  # tiny: most documents span several batches
    texts = corpus() if texts is None else texts
    enc = DiceEncoder(model, tok, pooling_impl="ref", **options)
    got = enc.encode_documents(texts, return_chunks=True)
    strategy = options.pop("strategy", "dice")
    ref_opts = dict(
        prefix=prefix, suffix=suffix, first_position=first, chunk_size=options["chunk_size"],
        overlap=options.get("overlap", 0), pooling=options["pooling"], aggregation=options.get("aggregation", "mean"),
        top_k=options.get("top_k", 2), temperature=options.get("temperature", 1.0),
        positions=options.get("positions", "local"), normalize_chunks=bool(options.get("normalize_chunks")),
        normalize=options.get("normalize", True), max_chunks=options.get("max_chunks_per_document"),
        text_prefix=options.get("document_prefix", ""), attention=options.get("attention", "model default"),
    )
    if strategy == "single":
        window = options["max_length"]
        ref_opts.update(chunk_size=window - len(prefix) - len(suffix), max_chunks=1, overlap=0)
    want, want_chunks = reference_encode(model, tok, texts, **ref_opts)
    # guard: the corpus really has the intended token counts (a tokenizer that merged words would
    # make every document one token and this test trivially true)
    assert got.document_tokens.tolist() == [len(t.split()) for t in texts]
    assert got.documents.shape == (len(texts), model.config.hidden_size)
    assert got.documents.dtype == np.float32
    assert_close(got.documents, want, ATOL, what=f"{arch} documents")
    assert_close(got.chunks, np.concatenate(want_chunks), ATOL, what=f"{arch} chunks")
    assert list(np.bincount(got.chunk_document, minlength=len(texts))) == [len(c) for c in want_chunks]
    return enc, got


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_architecture_matches_per_chunk_reference(arch):
    check(arch)


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
