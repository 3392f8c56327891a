"""The naive baselines compute what the engine computes: each is checked against the engine AND the
independent per-chunk oracle (`reference.reference_encode`), so a wrong baseline fails here even if
the engine were wrong the same way (the oracle shares no code with dice_fast).

Why these tests can fail — each checked by breaking `dice_fast/bench/baselines.py` on purpose and
running this file (2026-11-30):
* no padding mask (``attention_mask=None``): pad tokens become attention keys of the bidirectional
  cases -> 9 failures (bert, roberta, bidirectional qwen2; the causal ones rightly survive: right
  padding is invisible to a causal model);
* ``padded_sorted`` storing chunk vectors in sorted order (``chunks[lo:lo+len(idx)]`` instead of
  ``chunks[idx]``): documents get other documents' chunks -> every padded_sorted case fails;
* ``last`` pooling at the padded width instead of each chunk's length -> qwen2 / mistral fail;
* aggregation weights not the plan's wrapped chunk lengths -> the weighted_mean case fails.
(Dropping the explicit ``position_ids`` is not caught, and is not a bug: with right padding the
models' default positions are the same.) The guards in the test assert that the corpus really
exercises this: mixed chunk lengths inside a padded batch, and sorting that permutes the chunks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from dice_fast import DiceEncoder
from dice_fast.bench.baselines import encode_padded_naive, encode_padded_sorted, encode_sentence_transformers
from helpers import assert_close
from reference import reference_encode
from tiny_models import WORDS, tiny

ATOL = 1e-5  # float32 on CPU
K = 8  # chunk size
BATCH = 3  # chunks per padded batch


def corpus(seed: int = 0) -> list[str]:
    """Documents of 0 to 60 vocabulary words (one token each): empty, one token, exact multiples of K,
    one past a multiple, and random lengths, shuffled so neighbouring chunks differ in length."""
    rng = random.Random(seed)
    lengths = [0, 1, K - 1, K, K + 1, 2 * K, 3 * K + 5, 60] + [rng.randint(1, 40) for _ in range(6)]
    rng.shuffle(lengths)
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


CASES = [  # (arch, DICE options): >= 3 architectures, CLS/SEP, BOS-free, RoBERTa positions, causal
    ("bert", dict(pooling="mean")),
    ("roberta", dict(pooling="cls")),
    ("qwen2", dict(pooling="last")),
    ("mistral", dict(pooling="last")),
    ("qwen2", dict(pooling="mean", attention="bidirectional")),  # the 4-D mask path
    ("bert", dict(pooling="mean", overlap=3, aggregation="weighted_mean", document_prefix="passage :")),
    ("llama", dict(pooling="mean", aggregation="max", normalize_chunks=True)),
]


def oracle(arch: str, texts: list[str], **options) -> np.ndarray:
    model, tok, prefix, suffix, first = tiny(arch)
    docs, _ = reference_encode(
        model, tok, texts, prefix=prefix, suffix=suffix, first_position=first, chunk_size=K,
        overlap=options.get("overlap", 0), pooling=options["pooling"], aggregation=options.get("aggregation", "mean"),
        normalize_chunks=bool(options.get("normalize_chunks")), text_prefix=options.get("document_prefix", ""),
        attention=options.get("attention", "model default"),
    )
    return docs


@pytest.mark.parametrize("baseline", [encode_padded_sorted, encode_padded_naive], ids=["padded_sorted", "padded_naive"])
@pytest.mark.parametrize("arch,options", CASES, ids=[f"{a}-{'-'.join(map(str, o.values()))}" for a, o in CASES])
def test_padded_baselines_equal_engine_and_oracle(arch, options, baseline):
    model, tok, *_ = tiny(arch)
    enc = DiceEncoder(model, tok, chunk_size=K, max_batch_tokens=50, **options)
    texts = corpus()
    # guards: the padded batches mix chunk lengths, and sorting permutes the chunks
    lengths = enc.plan(texts).chunk_lengths
    naive_batches = [lengths[i : i + BATCH] for i in range(0, len(lengths), BATCH)]
    assert any(b.min() < b.max() for b in naive_batches)
    assert not np.array_equal(np.argsort(-lengths, kind="stable"), np.arange(len(lengths)))

    got = baseline(enc, texts, batch_size=BATCH)
    assert got.shape == (len(texts), model.config.hidden_size) and got.dtype == np.float32
    assert_close(got, oracle(arch, texts, **options), ATOL, what=f"{baseline.__name__} vs oracle")
    assert_close(got, enc.encode_documents(texts), ATOL, what=f"{baseline.__name__} vs engine")


def test_padded_baselines_batch_size_does_not_matter():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=K)
    texts = corpus(1)
    want = encode_padded_sorted(enc, texts, batch_size=1)
    for fn in (encode_padded_sorted, encode_padded_naive):
        for bs in (2, 5, 1000):
            assert_close(fn(enc, texts, batch_size=bs), want, ATOL, what=f"{fn.__name__} batch {bs}")
    assert encode_padded_naive(enc, [], 4).shape == (0, model.config.hidden_size)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        encode_padded_naive(enc, texts, batch_size=0)


ST_CASES = [("bert", "mean", False), ("roberta", "cls", True), ("mistral", "lasttoken", False)]


@pytest.mark.parametrize("arch,st_pooling,normalize", ST_CASES)
def test_sentence_transformers_baseline_equals_engine_and_oracle(tmp_path, arch, st_pooling, normalize):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    model, tok, *_ = tiny(arch)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    modules = [Transformer(str(tmp_path), max_seq_length=64), Pooling(model.config.hidden_size, st_pooling)]
    st = SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu")
    pooling = {"lasttoken": "last"}.get(st_pooling, st_pooling)
    enc = DiceEncoder(model, tok, chunk_size=K, pooling=pooling, normalize_chunks=normalize)
    # the word-level tokenizer decodes and re-tokenizes to the same ids, so this path is exact here
    texts = corpus(2)
    got = encode_sentence_transformers(st, enc, texts, batch_size=BATCH)
    assert got.shape == (len(texts), model.config.hidden_size)
    want = oracle(arch, texts, pooling=pooling, normalize_chunks=normalize)
    assert_close(got, want, ATOL, what="sentence-transformers vs oracle")
    assert_close(got, enc.encode_documents(texts), ATOL, what="sentence-transformers vs engine")
