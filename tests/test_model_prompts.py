"""A model folder's saved sentence-transformers prompts (``config_sentence_transformers.json``: e5's
"query: " / "passage: ", nomic's "search_query: ") are the encoder's default ``query_prefix`` /
``document_prefix``: what sentence-transformers' ``encode_query`` / ``encode_document`` apply, checked
against sentence-transformers itself. ``""`` turns them off; the sentence-transformers adapter keeps
sentence-transformers' own rules (``encode`` without a prompt applies none)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from dice_fast import DiceEncoder
from helpers import assert_close
from tiny_models import tiny

st_models = pytest.importorskip("sentence_transformers.models")
SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer

TOL = 2e-6
PROMPTS = {"query": "what is asked :", "document": "the text is :"}
TEXTS = ["the cat sat on a mat", "red house under blue sky", "a b c d"]  # one chunk each at chunk_size 16


def st_folder(tmp_path, prompts=PROMPTS, name="st"):
    """A saved sentence-transformers pipeline (tiny BERT, mean Pooling, Normalize) with ``prompts``;
    (folder, the SentenceTransformer loaded back from it)."""
    model, tok, *_ = tiny("bert")
    hf = tmp_path / f"{name}-hf"
    copy.deepcopy(model).save_pretrained(hf)
    tok.save_pretrained(hf)
    modules = [st_models.Transformer(str(hf), max_seq_length=64), st_models.Pooling(32, "mean"), st_models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(tmp_path / name))
    return tmp_path / name, SentenceTransformer(str(tmp_path / name), device="cpu", local_files_only=True)


def test_the_folders_prompts_are_the_default_prefixes(tmp_path):
    folder, st = st_folder(tmp_path)
    enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=16)
    assert (enc.config.document_prefix, enc.config.query_prefix) == (PROMPTS["document"], PROMPTS["query"])
    assert f"document_prefix={PROMPTS['document']!r}, query_prefix={PROMPTS['query']!r}" in repr(enc)
    assert_close(enc.encode_queries(TEXTS), st.encode_query(TEXTS, convert_to_numpy=True), TOL, what="queries")
    assert_close(enc.encode_documents(TEXTS), st.encode_document(TEXTS, convert_to_numpy=True), TOL,
                 what="one-chunk documents")
    same = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=16, document_prefix=PROMPTS["document"],
                                       query_prefix=PROMPTS["query"])
    np.testing.assert_array_equal(same.encode_queries(TEXTS), enc.encode_queries(TEXTS))

    off = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=16, document_prefix="", query_prefix="")
    assert "prefix" not in repr(off)
    plain = st.encode(TEXTS, convert_to_numpy=True)  # no prompt
    assert_close(off.encode_queries(TEXTS), plain, TOL, what="queries, prompts off")
    assert_close(off.encode_documents(TEXTS), plain, TOL, what="documents, prompts off")
    assert np.abs(off.encode_queries(TEXTS) - enc.encode_queries(TEXTS)).max() > 1e-3


@pytest.mark.parametrize("saved", [
    {"prompts": {"passage": "the text is :", "classification": "x"}},  # neither "document" nor "query"
    {"prompts": {"query": 3, "document": None}},
    {"prompts": ["query", "document"]},
    ["not", "an", "object"],
    "not JSON",
], ids=["other-names", "not-strings", "a-list", "file-a-list", "file-not-json"])
def test_prompts_it_cannot_take_leave_no_prefix(tmp_path, saved):
    """sentence-transformers 6's encode_document applies "document" only (it seeds it, empty, before
    "passage"); anything but a string prompt is no prompt; a file that is not a JSON object is none."""
    folder, st = st_folder(tmp_path, prompts=None)
    path = folder / "config_sentence_transformers.json"
    path.write_text(saved if isinstance(saved, str) else json.dumps(saved))
    enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=16)
    assert (enc.config.document_prefix, enc.config.query_prefix) == ("", "")
    assert_close(enc.encode_documents(TEXTS), st.encode(TEXTS, convert_to_numpy=True), TOL, what="no prompt")


def test_the_sentence_transformers_adapter_keeps_its_own_rules(tmp_path):
    """Built from the folder: ``encode`` applies no prompt, ``encode_query`` / ``encode_document`` the
    saved ones, and a prompt set to "" turns one off, as sentence-transformers does."""
    from dice_fast.integrations.sentence_transformers import DiceSentenceEncoder

    folder, st = st_folder(tmp_path)
    ours = DiceSentenceEncoder(str(folder), device="cpu", chunk_size=16)
    assert_close(ours.encode(TEXTS), st.encode(TEXTS, convert_to_numpy=True), TOL, what="encode")
    assert_close(ours.encode_query(TEXTS), st.encode_query(TEXTS, convert_to_numpy=True), TOL, what="encode_query")
    assert_close(ours.encode_document(TEXTS), st.encode_document(TEXTS, convert_to_numpy=True), TOL,
                 what="encode_document")
    off = DiceSentenceEncoder(str(folder), prompts={"query": ""}, device="cpu", chunk_size=16)
    st_off = SentenceTransformer(str(folder), device="cpu", local_files_only=True, prompts={"query": ""})
    assert_close(off.encode_query(TEXTS), st_off.encode_query(TEXTS, convert_to_numpy=True), TOL,
                 what="encode_query, its prompt off")
