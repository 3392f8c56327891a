"""strategy="late" passes through every adapter: LangChain, LlamaIndex, the sentence-transformers encode,
the Ray Data stage and the DiceIndex give exactly the vectors of a late-chunking `DiceEncoder`."""

from __future__ import annotations

import numpy as np
import pytest

from dice_fast import DiceEncoder

OPTIONS = dict(strategy="late", chunk_size=48, window_overlap=32, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def late(bundled):
    return DiceEncoder(bundled.model, bundled.tokenizer, config=bundled.config.replace(
        strategy="late", chunk_size=48, window_overlap=32))


@pytest.fixture(scope="module")
def docs(haystack):
    return ["A cat sat on the mat.", "Où est la gare ?", haystack.texts[0][:3000], haystack.texts[4]]


def test_late_differs_from_dice(late, bundled, docs):
    assert late.config.strategy == "late"
    assert not np.allclose(late.encode_documents(docs[2:]), bundled.encode_documents(docs[2:]), atol=1e-3)


def test_langchain(late, docs):
    pytest.importorskip("langchain_core")
    from dice_fast.integrations.langchain import DiceEmbeddings

    emb = DiceEmbeddings(None, **OPTIONS)
    assert emb.encoder.config.strategy == "late"
    np.testing.assert_allclose(np.asarray(emb.embed_documents(docs), np.float32), late.encode_documents(docs), atol=1e-6)


def test_llama_index(late, docs):
    pytest.importorskip("llama_index.core")
    from dice_fast.integrations.llama_index import DiceEmbedding

    emb = DiceEmbedding(None, **OPTIONS)
    got = np.asarray(emb.get_text_embedding_batch(docs), np.float32)
    np.testing.assert_allclose(got, late.encode_documents(docs), atol=1e-6)


def test_sentence_transformers(late, docs):
    from dice_fast.integrations.sentence_transformers import DiceSentenceEncoder

    model = DiceSentenceEncoder(None, **OPTIONS)
    np.testing.assert_allclose(model.encode(docs), late.encode_documents(docs), atol=1e-6)


def test_ray_stage_callable(late, docs):
    pytest.importorskip("ray")
    pa = pytest.importorskip("pyarrow")
    from dice_fast.integrations.ray import DiceEmbedder

    emb = DiceEmbedder(None, **OPTIONS)
    got = emb(pa.table({"text": docs}))
    rows = np.stack([np.asarray(v, np.float32) for v in got.column("embedding").to_pylist()])
    np.testing.assert_allclose(rows, late.encode_documents(docs), atol=1e-6)


def test_dice_index_scorings_with_late_chunks(late, docs, haystack):
    from dice_fast.index import DiceIndex

    index = DiceIndex.from_texts(late, haystack.texts, haystack.ids)
    for scoring in ("dice", "maxsim", "hybrid"):
        hits = index.search([haystack.query], k=1, scoring=scoring)[0]
        assert hits[0].id == haystack.ids[haystack.target], scoring
    assert "smoked cardamom" in index.search([haystack.query], k=1, scoring="maxsim")[0][0].text
