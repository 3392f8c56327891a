"""The sentence-transformers-shaped encode: code written for SentenceTransformer runs unchanged, gives
the engine's vectors, and for one-chunk texts the real SentenceTransformer's vectors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from dice_fast.integrations.sentence_transformers import DiceSentenceEncoder
from dice_fast.matryoshka import truncate

SHORT = ["A cat sat on the mat.", "Packed attention keeps every chunk to itself.",
         "Où est la gare ?", "", "Numbers 12345 and symbols #$%!"]
QUERIES = ["where does the cat sit?", "what does packed attention do?"]


def _long(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = ("river stone lantern quiet engine maple harbor violet signal orchard copper meadow "
             "thunder cedar galaxy pencil").split()
    return " ".join(rng.choice(words, n_words))


DOCS = SHORT + [_long(120, 1), _long(300, 2)]


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def enc(offline):
    return DiceEncoder.from_pretrained(None, chunk_size=32)  # long documents get many chunks


@pytest.fixture(scope="module")
def model(enc):
    return DiceSentenceEncoder(enc)


@pytest.fixture(scope="module")
def st_model(offline):
    from sentence_transformers import SentenceTransformer

    from dice_fast.models import default_model_path

    return SentenceTransformer(default_model_path(), device="cpu")


def test_sentence_transformers_code_runs_unchanged(model, enc):
    want = enc.encode_documents(DOCS)

    emb = model.encode(DOCS, convert_to_tensor=True, normalize_embeddings=True)
    assert isinstance(emb, torch.Tensor) and emb.shape == (len(DOCS), 384) and emb.dtype == torch.float32
    np.testing.assert_allclose(emb.numpy(), want, atol=1e-6)

    arr = model.encode(DOCS, batch_size=16, show_progress_bar=False)      # numpy by default
    assert isinstance(arr, np.ndarray) and arr.shape == (len(DOCS), 384)
    np.testing.assert_allclose(arr, want, atol=1e-6)

    one = model.encode(DOCS[-1])                                          # a string -> 1-D
    assert one.shape == (384,)
    np.testing.assert_allclose(one, want[-1], atol=1e-6)
    one_t = model.encode(DOCS[0], convert_to_tensor=True)
    assert one_t.shape == (384,)

    rows = model.encode(DOCS, convert_to_numpy=False)                     # a list of 1-D tensors
    assert isinstance(rows, list) and len(rows) == len(DOCS) and rows[0].shape == (384,)
    np.testing.assert_allclose(torch.stack(rows).numpy(), want, atol=1e-6)
    np.testing.assert_allclose(model.encode(inputs=DOCS), want, atol=1e-6)  # sentence-transformers 6 name
    np.testing.assert_allclose(model.encode(np.array(DOCS, dtype=object)), want, atol=1e-6)

    q = model.encode_query(QUERIES)
    np.testing.assert_allclose(q, enc.encode_queries(QUERIES), atol=1e-6)
    np.testing.assert_allclose(model.encode(QUERIES, task="query"), q, atol=1e-6)
    np.testing.assert_allclose(model.encode_document(DOCS), want, atol=1e-6)

    sim = model.similarity(q, arr)
    assert isinstance(sim, torch.Tensor) and sim.shape == (len(QUERIES), len(DOCS))
    np.testing.assert_allclose(sim.numpy(), q @ want.T, atol=1e-5)
    assert model.similarity_pairwise(arr[:2], arr[:2]).shape == (2,)
    assert model.get_sentence_embedding_dimension() == 384 and model.max_seq_length == enc.window
    assert model.encode([]).shape == (0, 384)


def test_equals_sentence_transformers_on_one_chunk_texts(st_model, offline):
    model = DiceSentenceEncoder()                 # bundled model, default chunk size: every text is one chunk
    texts = [t for t in SHORT if t] + QUERIES     # ("" is one chunk too, but ST pads it differently: skip)
    for ours, theirs in (
        (model.encode(texts), st_model.encode(texts)),
        (model.encode(texts, normalize_embeddings=True, convert_to_tensor=True).numpy(),
         st_model.encode(texts, normalize_embeddings=True, convert_to_tensor=True).numpy()),
        (model.encode_query(texts), st_model.encode_query(texts)),
        (model.encode_document(texts), st_model.encode_document(texts)),
    ):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_prompts_match_sentence_transformers_and_apply_per_chunk(enc, st_model):
    prompts = {"query": "query: ", "passage": "passage: ", "topic": "topic: "}
    model = DiceSentenceEncoder(enc, prompts=prompts)
    short = [t for t in SHORT if t]

    # one-chunk texts: the prompt as a prefix is what sentence-transformers builds (WordPiece)
    st_model.prompts = prompts
    try:
        np.testing.assert_allclose(model.encode_query(short), st_model.encode_query(short), atol=1e-5)
        np.testing.assert_allclose(model.encode(short[:3], prompt_name="topic"),
                                   st_model.encode(short[:3], prompt_name="topic"), atol=1e-5)
        np.testing.assert_allclose(model.encode(short[:3], prompt="x: "), st_model.encode(short[:3], prompt="x: "),
                                   atol=1e-5)
    finally:
        st_model.prompts = {"query": "", "document": ""}

    # long documents: the prompt is the document prefix of every chunk
    with_prefix = DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(document_prefix="passage: "))
    np.testing.assert_allclose(model.encode_document(DOCS, prompt_name="passage"), with_prefix.encode_documents(DOCS),
                               atol=1e-6)
    # as in sentence-transformers 6, "document" is always a prompt ("" here): encode_document uses it, not "passage"
    assert model.prompts["document"] == ""
    np.testing.assert_allclose(model.encode_document(DOCS), enc.encode_documents(DOCS), atol=1e-6)
    with_q = DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(query_prefix="query: "))
    np.testing.assert_allclose(model.encode_query(QUERIES), with_q.encode_queries(QUERIES), atol=1e-6)
    np.testing.assert_allclose(model.encode(DOCS), enc.encode_documents(DOCS), atol=1e-6)  # no prompt named

    with pytest.raises(ValueError, match="not among the prompts"):
        model.encode(DOCS, prompt_name="nope")


def test_batch_size_caps_the_token_budget_not_the_vectors(model, enc):
    want = enc.encode_documents(DOCS)
    np.testing.assert_allclose(model.encode(DOCS, batch_size=1), want, atol=1e-6)
    assert model._encoder_for(None, None, 1).max_batch_tokens == enc.window
    assert model._encoder_for(None, None, 10**6) is enc                 # never above the encoder's budget
    with pytest.raises(ValueError, match="batch_size"):
        model.encode(DOCS, batch_size=0)


def test_truncate_dim_and_normalize(enc):
    model = DiceSentenceEncoder(enc, truncate_dim=64)
    out = model.encode(DOCS, normalize_embeddings=True)
    assert out.shape == (len(DOCS), 64) and model.get_sentence_embedding_dimension() == 64
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    # the engine's truncate_dim: the first 32 components, re-normalised as the encoder normalises
    want = DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(truncate_dim=32)).encode_documents(DOCS)
    np.testing.assert_allclose(model.encode(DOCS, truncate_dim=32), want, atol=1e-6)
    np.testing.assert_allclose(want, truncate(enc.encode_documents(DOCS), 32, normalize=True), atol=1e-6)


def test_unsupported_arguments_say_what_to_do(model):
    for kwargs, match in (({"precision": "int8"}, "float32 only"), ({"output_value": "token_embeddings"}, "sentence_embedding"),
                          ({"device": "cuda"}, "runs on cpu"), ({"chunk_size": 8}, "encoder option"),
                          ({"task": "passage"}, "task must be"), ({"truncate_dim": 1000}, "truncate_dim")):
        with pytest.raises(ValueError, match=match):
            model.encode(DOCS, **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword"):
        model.encode(DOCS, not_an_argument=1)
    with pytest.raises(TypeError, match="options"):
        DiceSentenceEncoder(model.encoder, chunk_size=16)
    assert model.encode(DOCS[:2], device="cpu").shape == (2, 384)


def test_variants_share_the_chunk_cache_and_its_counts(enc, tmp_path):
    """batch_size / prompt / truncate_dim variants reuse the base encoder's persistent chunk cache and
    count in its chunk_stats: a variant that only changes the forward budget recomputes nothing."""
    from dice_fast.models import default_model_path

    base = DiceEncoder(enc.model, enc.tokenizer, config=enc.config, model_path=default_model_path(),
                       cache=tmp_path / "chunks")
    model = DiceSentenceEncoder(base)
    want = model.encode(DOCS)
    computed = base.chunk_stats.snapshot()["computed"]
    assert computed > len(DOCS)  # the long documents have many chunks

    np.testing.assert_allclose(model.encode(DOCS, batch_size=1), want, atol=1e-6)
    np.testing.assert_allclose(model.encode(DOCS, truncate_dim=64), truncate(want, 64, normalize=True), atol=1e-6)
    stats = base.chunk_stats.snapshot()
    assert stats["computed"] == computed and stats["disk_hits"] >= 2 * computed  # both served from the cache
    variant = model._encoder_for(None, None, 1)
    assert variant is not base and variant.cache is not None and variant.chunk_stats is base.chunk_stats

    model.encode(DOCS, prompt="passage: ")  # other chunk ids: computed, counted in the base's stats, cached
    assert base.chunk_stats.snapshot()["computed"] > computed
    again = base.chunk_stats.snapshot()["computed"]
    model.encode(DOCS, prompt="passage: ", batch_size=2)
    assert base.chunk_stats.snapshot()["computed"] == again


def test_variants_read_the_model_facts_from_the_encoders_folder(enc):
    """An encoder built with model_path= whose model names another place (a Hub id, a moved folder) keeps
    the folder's facts (window 256 from its sentence-transformers config) in every variant."""
    import copy

    from dice_fast.models import default_model_path

    moved = copy.deepcopy(enc.model)
    moved.config._name_or_path = "sentence-transformers/all-MiniLM-L6-v2"  # not a folder here
    base = DiceEncoder(moved, enc.tokenizer, model_path=default_model_path(), chunk_size=32)
    assert base.window == 256 and base.model_path == default_model_path()
    model = DiceSentenceEncoder(base)
    want = enc.encode_documents(DOCS)
    np.testing.assert_allclose(model.encode(DOCS, batch_size=1), want, atol=1e-6)
    assert model.encode(DOCS, truncate_dim=64).shape == (len(DOCS), 64)
    with_prefix = DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(document_prefix="passage: "))
    np.testing.assert_allclose(model.encode(DOCS, prompt="passage: "), with_prefix.encode_documents(DOCS), atol=1e-6)


def test_encode_query_and_document_never_fall_back_to_the_default_prompt(enc, offline):
    """sentence-transformers 6 seeds the prompts with {"query": "", "document": ""}, so encode_query /
    encode_document use those (no prompt) and only encode falls back to default_prompt_name."""
    from sentence_transformers import SentenceTransformer

    from dice_fast.models import default_model_path

    prompts = {"clf": "Classify the sentiment: "}
    st = SentenceTransformer(default_model_path(), device="cpu", prompts=prompts, default_prompt_name="clf")
    model = DiceSentenceEncoder(prompts=prompts, default_prompt_name="clf")
    assert model.prompts == st.prompts == {"query": "", "document": "", "clf": "Classify the sentiment: "}
    plain = enc.encode_documents(QUERIES)
    np.testing.assert_allclose(model.encode_query(QUERIES), st.encode_query(QUERIES), atol=1e-5)
    np.testing.assert_allclose(model.encode_document(QUERIES), st.encode_document(QUERIES), atol=1e-5)
    np.testing.assert_allclose(model.encode_document(QUERIES), plain, atol=1e-6)  # no prompt at all
    np.testing.assert_allclose(model.encode(QUERIES), st.encode(QUERIES), atol=1e-5)  # encode: the default prompt
    assert np.abs(model.encode(QUERIES) - plain).max() > 1e-3

    # an empty prompt is no prompt: the encoder's own prefix stays
    prefixed = DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(query_prefix="query: "))
    np.testing.assert_allclose(DiceSentenceEncoder(prefixed).encode_query(QUERIES), prefixed.encode_queries(QUERIES),
                               atol=1e-6)


def test_similarity_follows_similarity_fn_name_as_sentence_transformers_does(enc, tiny_folder, tmp_path):
    import json
    import shutil

    from sentence_transformers.util import SimilarityFunction

    from dice_fast.errors import OptionError

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 8)).astype(np.float32), rng.normal(size=(4, 8)).astype(np.float32)
    model = DiceSentenceEncoder(enc)
    assert model.similarity_fn_name == "cosine"
    for name in ("cosine", "dot", "euclidean", "manhattan"):
        model.similarity_fn_name = name
        want = SimilarityFunction.to_similarity_fn(name)(a, b)
        np.testing.assert_allclose(model.similarity(a, b).numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
        want_pairs = SimilarityFunction.to_similarity_pairwise_fn(name)(a, b[:3])
        np.testing.assert_allclose(model.similarity_pairwise(a, b[:3]).numpy(), want_pairs.numpy(),
                                   rtol=1e-5, atol=1e-5)
    model.similarity_fn_name = SimilarityFunction.DOT_PRODUCT  # the enum is taken too
    assert model.similarity_fn_name == "dot"
    assert float(model.similarity(np.array([3.0, 4.0]), np.array([6.0, 0.0]))) == 18.0
    assert DiceSentenceEncoder(enc, similarity_fn_name="euclidean").similarity_fn_name == "euclidean"
    with pytest.raises(OptionError, match="similarity_fn_name"):
        DiceSentenceEncoder(enc, similarity_fn_name="maxsim")

    # the model folder's sentence-transformers config names it, as SentenceTransformer reads it
    folder = shutil.copytree(tiny_folder, tmp_path / "dot-model")
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "dot"}))
    assert DiceSentenceEncoder(folder, device="cpu", dtype="float32").similarity_fn_name == "dot"
    assert DiceSentenceEncoder(folder, similarity_fn_name="cosine", device="cpu").similarity_fn_name == "cosine"


def test_vectors_are_normalised_as_the_folders_pipeline_does(tiny_folder, tmp_path, offline):
    """A folder whose pipeline has no ``Normalize`` (a dot-product model) gives SentenceTransformer's raw
    pooled vectors (they were made unit length: dot scores and rankings changed); one with it, unit
    vectors; ``normalize=`` given, or a built DiceEncoder, decides for itself."""
    import json
    import shutil

    from sentence_transformers import SentenceTransformer

    from tiny_models import WORDS

    texts = [" ".join(WORDS[i : i + 6]) for i in range(0, 24, 6)]  # one chunk each
    folder = shutil.copytree(tiny_folder, tmp_path / "dot-model")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                  "pooling_mode_mean_tokens": True}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    for normalizes in (False, True):
        steps = modules + [{"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"}] * normalizes
        (folder / "modules.json").write_text(json.dumps(steps))
        want = SentenceTransformer(str(folder), device="cpu").encode(texts)
        got = DiceSentenceEncoder(folder, device="cpu").encode(texts)
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0) == normalizes
    (folder / "modules.json").write_text(json.dumps(modules))
    unit = DiceSentenceEncoder(str(folder), device="cpu", normalize=True).encode(texts)
    assert np.allclose(np.linalg.norm(unit, axis=1), 1.0)


def test_max_seq_length_can_be_set_as_in_sentence_transformers(enc, st_model):
    """``model.max_seq_length = 16`` (common in sentence-transformers code) raised AttributeError: it sets
    the window (the engine's max_length) on a variant sharing the model; a query is cut to it as
    SentenceTransformer cuts it."""
    import warnings

    model = DiceSentenceEncoder(enc)
    query = "where does the cat that sat on the big red mat under the tree go when it rains all day"
    model.max_seq_length = 16
    assert model.max_seq_length == 16 and model.encoder.model is enc.model and enc.window == 256
    old = st_model.max_seq_length
    st_model.max_seq_length = 16
    try:
        want = st_model.encode([query])
    finally:
        st_model.max_seq_length = old
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the query is cut to the window, with a warning
        got = model.encode_query([query])
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError):
        model.max_seq_length = 0


def test_a_hub_name_keeps_the_engines_normalize(monkeypatch):
    """Only a folder's pipeline is read: a hub name (no folder here) was given normalize=False, so a
    model whose pipeline ends in Normalize returned vectors of norm 5-8."""
    import dice_fast.integrations.sentence_transformers as st

    seen = []

    class Loaded(Exception):
        pass

    def as_encoder(encoder, options, **how):
        seen.append(options)
        raise Loaded

    monkeypatch.setattr(st, "as_encoder", as_encoder)
    with pytest.raises(Loaded):
        DiceSentenceEncoder("sentence-transformers/all-MiniLM-L6-v2", chunk_size=64)
    assert seen == [{"chunk_size": 64}]
