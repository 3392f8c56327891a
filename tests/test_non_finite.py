"""A model's NaN or infinity is never returned, cached, indexed or served as a vector: the input is
named (`NonFiniteOutput`), and the others packed with it are untouched (attention never crosses
inputs). A model that overflows its precision (float16 past 65,504) or holds a NaN weight gave NaN rows
silently: to the caller, into `.npy` and Parquet outputs, into the chunk cache (served on every later
run) and, as JSON nulls, from the server."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dice_fast import ChunkCache, DiceEncoder, DiceIndex, NonFiniteOutput
from tiny_models import tiny

TEXTS = ["the cat sat on a mat", "green old river water fire road city", "a dog ran under the blue sky"]


def encoder(**options):
    """An encoder over a copy of the tiny BERT (`tiny` caches the models the other tests share)."""
    model, tok = tiny("bert")[:2]
    return DiceEncoder(copy.deepcopy(model), tok, chunk_size=4, pooling="mean", pooling_impl="torch", **options)


def poison(enc, word: str, value=float("nan")):
    """Set the embedding row of ``word``'s first token to ``value`` (after the encoder's probe ran);
    returns the row's old value."""
    tid = enc.tokenizer(word, add_special_tokens=False)["input_ids"][0]
    row = enc.model.get_input_embeddings().weight
    old = row[tid].clone()
    with torch.no_grad():
        row[tid] = value
    return tid, old


def test_the_input_is_named_and_the_others_are_exact(tmp_path):
    clean = encoder().encode_documents(TEXTS, return_chunks=True)
    enc = encoder(cache=str(tmp_path / "cache"))
    tid, old = poison(enc, "river")
    with pytest.raises(NonFiniteOutput, match=r"output for documents\[1\] is not finite \(NaN or infinite\) in "
                                              r"float32") as caught:
        enc.encode_documents(TEXTS)
    assert caught.value.index == 1 and isinstance(caught.value, RuntimeError)
    with pytest.raises(NonFiniteOutput, match=r"queries\[1\]"):
        enc.encode_queries(["a cat", "river"])
    for inf in (float("inf"), float("-inf")):
        with torch.no_grad():
            enc.model.get_input_embeddings().weight[tid] = inf
        with pytest.raises(NonFiniteOutput, match=r"documents\[1\]"):
            enc.encode_documents(TEXTS, return_chunks=True)
    alone = enc.encode_documents([TEXTS[0], TEXTS[2]], return_chunks=True)
    np.testing.assert_allclose(alone.documents, clean.documents[[0, 2]], atol=1e-6)  # packed beside it: exact
    # the NaN chunks were never cached: with the weight restored the same encoder (same cache key) is exact
    with torch.no_grad():
        enc.model.get_input_embeddings().weight[tid] = old
    np.testing.assert_allclose(enc.encode_documents(TEXTS), clean.documents, atol=1e-6)


def test_the_message_names_the_precision_not_an_openvino_identity():
    """The server sends the message to its clients: an OpenVINO model's identity (versions, hashes) stays in."""
    error = NonFiniteOutput(3, "int8 (openvino 2026.4.1, model 1a2b, calibration 3c4d)", "input[3]")
    assert "input[3] is not finite (NaN or infinite) in int8:" in str(error) and "openvino" not in str(error)


def test_an_index_refuses_a_query_the_model_cannot_encode():
    """A query vector array with NaN was refused, but a query string encoding to NaN returned no hits."""
    enc = encoder()
    index = DiceIndex.from_texts(enc, TEXTS, ids=["a", "b", "c"])
    poison(enc, "river")
    with pytest.raises(NonFiniteOutput, match=r"queries\[0\]"):
        index.search(["river"], k=2)
    assert [h.id for h in index.search(["a cat"], k=1)[0]] == ["a"]


def test_the_probe_names_a_model_that_gives_nan():
    """The start-up probe compared packed with per-chunk outputs: a NaN made it say "differs (relative
    error nan)" and choose the padded fallback, naming the wrong cause."""
    model, tok = tiny("bert")[:2]
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.embeddings.LayerNorm.weight[0] = float("nan")
    enc = DiceEncoder(model, tok, chunk_size=4)
    assert "gives NaN or infinite hidden states in float32" in repr(enc), repr(enc)
    with pytest.raises(NonFiniteOutput, match=r"documents\[0\]"):
        enc.encode_documents(TEXTS[:1])


def test_vectors_whose_norm_overflows_float32_are_named_not_zeros():
    """Hidden states past ~1e18 are finite, but their float32 norm is not: normalised, every vector was
    returned as zeros, silently (RESULTS §30)."""
    enc = encoder()
    with torch.no_grad():
        enc.model.encoder.layer[-1].output.LayerNorm.weight.mul_(1e19)
    with pytest.raises(NonFiniteOutput, match=r"documents\[0\]"):
        enc.encode_documents(TEXTS)
    with pytest.raises(NonFiniteOutput, match=r"queries\[0\]"):
        enc.encode_queries(["a cat"])
