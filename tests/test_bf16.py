"""bf16 on any length mix: a chunk's bf16 vector does not depend on the lengths of its batch
neighbours (equal-length batch vs mixed-length batch), and agrees with the per-chunk oracle."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from dice_fast import DiceEncoder
from oracle import K, corpus, text_of
from reference import reference_encode
from tiny_models import tiny

# bf16 keeps 8 bits of mantissa: one rounding of a unit-scale value is <= 2^-9 = 0.002; the chunk
# vectors below are the mean of a few bf16 token states, so batch-to-batch differences, if any,
# stay within a few roundings
BF16_CHUNK_ATOL = 8e-3
BF16_ORACLE_ATOL = 2e-2  # engine vs oracle, both in bf16: packing changes the order of roundings


@pytest.fixture(scope="module")
def encoder():
    model, tok, *_ = tiny("bert")
    return DiceEncoder(copy.deepcopy(model), tok, chunk_size=K, dtype="bfloat16", max_batch_tokens=80,
                       pooling_impl="torch", normalize_chunks=False, normalize=False)


def test_chunk_vector_same_in_uniform_and_mixed_batches(encoder):
    rng = random.Random(5)
    probe = text_of(K, rng)
    uniform = [probe] + [text_of(K, rng) for _ in range(6)]  # one run of equal lengths
    mixed = [probe] + [text_of(n, rng) for n in (1, 2, 3, 5, 6, 7)]  # every chunk its own run
    a = encoder.encode_documents(uniform, return_chunks=True).chunks[0]
    b = encoder.encode_documents(mixed, return_chunks=True).chunks[0]
    alone = encoder.encode_documents([probe], return_chunks=True).chunks[0]
    assert np.abs(a - b).max() <= BF16_CHUNK_ATOL and np.abs(a - alone).max() <= BF16_CHUNK_ATOL
    assert np.abs(a).max() > 0.1  # the vectors are not trivially zero


def test_bf16_mixed_lengths_agree_with_oracle(encoder):
    texts = corpus(seed=2)
    got = encoder.encode_documents(texts, return_chunks=True)
    model, _, prefix, suffix, first = tiny("bert")
    want, want_chunks = reference_encode(encoder.model, encoder.tokenizer, texts, prefix=prefix, suffix=suffix,
                                         first_position=first, chunk_size=K, pooling="mean", normalize=False)
    err = np.abs(got.chunks - np.concatenate(want_chunks)).max()
    assert err <= BF16_ORACLE_ATOL, err
