"""Matryoshka ``truncate_dim``: the first d components of the full vectors the oracle computes (each
chunk alone, float64 aggregation), re-normalised exactly when the output is normalised; refused above
the model's width or below 1."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from dice_fast.matryoshka import check_dim, truncate
from helpers import assert_close
from oracle import ATOL, K, corpus, text_of
from reference import reference_encode
from tiny_models import tiny

D = 12  # of the tiny models' 32


def _cut(rows: np.ndarray, d: int, normalize: bool) -> np.ndarray:
    """float64 reference: the first d columns, divided by max(norm, 1e-12) when ``normalize``."""
    out = np.asarray(rows, np.float64)[:, :d]
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12) if normalize else out


@pytest.mark.parametrize("normalize,normalize_chunks,aggregation", [(True, False, "mean"), (False, True, "topk_norm")])
def test_documents_chunks_and_queries_are_the_oracle_truncated(normalize, normalize_chunks, aggregation):
    """Re-normalised exactly where the output is normalised; topk_norm ranks chunks by their full-width
    norm: truncation comes after aggregating."""
    model, tok, prefix, suffix, first = tiny("bert")
    rng = random.Random(5)
    texts = [text_of(n, rng) for n in (0, 1, K, 2 * K + 3, 5 * K)]
    opts = dict(chunk_size=K, pooling="mean", aggregation=aggregation, normalize_chunks=normalize_chunks)
    enc = DiceEncoder(model, tok, max_batch_tokens=24, truncate_dim=D, normalize=normalize, **opts)
    assert enc.dim == D
    got = enc.encode_documents(texts, return_chunks=True)
    raw, want_chunks = reference_encode(model, tok, texts, prefix=prefix, suffix=suffix, first_position=first,
                                        chunk_size=K, pooling="mean", aggregation=aggregation,
                                        normalize_chunks=normalize_chunks, normalize=False)
    assert got.documents.shape == (len(texts), D) and got.documents.dtype == np.float32
    assert_close(got.documents, _cut(raw, D, normalize), ATOL, what="documents")
    assert_close(got.chunks, _cut(np.concatenate(want_chunks), D, normalize_chunks), ATOL, what="chunks")
    queries = ["the cat sat on a mat", "what is the big red house"]
    full = DiceEncoder(model, tok, normalize=False, **opts).encode_queries(queries)
    assert_close(enc.encode_queries(queries), _cut(full, D, normalize), ATOL, what="queries")
    assert enc.encode_documents([]).shape == (0, D)


def test_full_width_is_the_untruncated_engine():
    model, tok, *_ = tiny("bert")
    texts = corpus(seed=6)
    full = DiceEncoder(model, tok, chunk_size=K).encode_documents(texts)
    same = DiceEncoder(model, tok, chunk_size=K, truncate_dim=model.config.hidden_size).encode_documents(texts)
    np.testing.assert_array_equal(same, full)


@pytest.mark.parametrize("bad", [0, -3, 33, 10**9, True, 2.0, "8"])
def test_truncate_dim_outside_the_model_width_is_refused(bad):
    model, tok, *_ = tiny("bert")
    with pytest.raises(ValueError, match="truncate_dim"):
        DiceEncoder(model, tok, truncate_dim=bad)


def test_truncate_helper_keeps_the_input_and_agrees_between_numpy_and_torch():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((5, 16)).astype(np.float32)
    rows[3] = 0.0  # a zero row stays zero, never NaN
    for n in (1, 5):  # one row of a C-contiguous array is itself contiguous: still copied, never scaled
        x = rows[:n].copy()
        before = x.copy()
        out = truncate(x, 4, normalize=True)
        np.testing.assert_array_equal(x, before)
        assert out.shape == (n, 4) and out.flags.c_contiguous
        np.testing.assert_allclose(out, _cut(x, 4, True), atol=1e-6)
        np.testing.assert_allclose(truncate(torch.from_numpy(x), 4, True).numpy(), out, atol=1e-6)
    np.testing.assert_array_equal(truncate(rows, 4, normalize=False), rows[:, :4])
    assert truncate(rows, None, True) is rows and truncate(rows, 16, True) is rows
    assert check_dim(None, 8) is None and check_dim(np.int64(8), 8) == 8
    with pytest.raises(ValueError, match=r"dimensions must be an integer from 1 to 8"):
        check_dim(9, 8, "dimensions")


def test_the_evaluation_refuses_truncated_vectors():
    """Its diagnostics compare full-width chunk vectors with queries: it says so instead of misreading."""
    from dice_fast.eval.run import run_eval

    model, tok, *_ = tiny("bert")
    with pytest.raises(ValueError, match="does not support truncate_dim"):
        run_eval(None, DiceEncoder(model, tok, truncate_dim=D))
