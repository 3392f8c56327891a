"""The oracle check shared by the exactness tests: encode a corpus with the engine and compare every
document and chunk vector with `reference.reference_encode` (each chunk alone, float64 aggregation)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dice_fast import DiceEncoder
from helpers import assert_close
from reference import reference_encode, text_after_prefix
from tiny_models import WORDS, tiny, tiny_subword

# every pooling implementation that runs on the CPU: vectorised PyTorch (the default without the C++
# extension), Triton under its interpreter, the C++ op (built on demand; skipped without a compiler)
CPU_POOLING_IMPLS = ("torch", "triton", "native")


def _native_or_skip():
    from dice_fast.ops import native

    if not native.is_loaded():
        try:
            native.build()
        except RuntimeError as exc:  # no compiler / ninja here
            pytest.skip(f"C++ extension not buildable: {exc}")


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


def check(arch, texts=None, tokenizer: str = "word", **options):
    """Engine vs oracle on ``arch`` with a ``tokenizer`` of kind "word" (one token per word, tokens
    counted by words), "bpe" (byte-level BPE) or "unigram" (SentencePiece-style)."""
    model, tok, prefix, suffix, first = tiny(arch) if tokenizer == "word" else tiny_subword(arch, tokenizer)
    options.setdefault("chunk_size", K)
    options.setdefault("pooling", default_pooling(arch))
    options.setdefault("max_batch_tokens", 40)  # tiny: most documents span several batches
    texts = corpus() if texts is None else texts
    options.setdefault("pooling_impl", "torch")
    if options["pooling_impl"] == "native":
        _native_or_skip()
    enc = DiceEncoder(model, tok, **options)
    got = enc.encode_documents(texts, return_chunks=True)
    strategy = options.pop("strategy", "dice")
    options.pop("pooling_impl")
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
    if tokenizer == "word":
        assert got.document_tokens.tolist() == [len(t.split()) for t in texts]
    else:  # subword: more tokens than words, counted by the tokenizer itself
        counts = [len(text_after_prefix(tok, options.get("document_prefix", ""), t)) for t in texts]
        assert got.document_tokens.tolist() == counts and sum(counts) > sum(len(t.split()) for t in texts)
    assert got.documents.shape == (len(texts), model.config.hidden_size)
    assert got.documents.dtype == np.float32
    assert_close(got.documents, want, ATOL, what=f"{arch} documents")
    assert_close(got.chunks, np.concatenate(want_chunks), ATOL, what=f"{arch} chunks")
    assert list(np.bincount(got.chunk_document, minlength=len(texts))) == [len(c) for c in want_chunks]
    return enc, got


