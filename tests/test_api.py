"""Public API behaviour: options, bad input, queries, the bundled real model, lean import."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from dice_fast import DiceConfig, DiceEncoder
from dice_fast.models import special_tokens_around_text
from helpers import assert_close
from reference import reference_encode
from dice_fast.models import default_model_path
from tiny_models import ARCHS, tiny


@pytest.fixture(scope="module")
def bert():
    model, tok, *_ = tiny("bert")
    return DiceEncoder(model, tok, chunk_size=8)


@pytest.fixture(scope="module")
def minilm():
    return DiceEncoder.from_pretrained(chunk_size=64)


def test_lean_import_touches_no_gpu_and_no_optional_packages():
    code = (
        "import sys, dice_fast, dice_fast.ops\n"
        "import torch\n"
        "heavy = [m for m in ('transformers', 'triton', 'flash_attn', 'flash_attn_interface', 'dice_fast.ops.native',"
        " 'dice_fast.ops.triton_pool') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_special_tokens_are_found_from_the_tokenizer(arch):
    _, tok, prefix, suffix, _ = tiny(arch)
    assert special_tokens_around_text(tok) == (prefix, suffix)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_first_position_and_causality_are_read_from_the_model(arch):
    model, tok, _, _, first = tiny(arch)
    enc = DiceEncoder(model, tok, chunk_size=8)
    assert enc.spec.first_position == first
    assert enc.spec.is_causal == (arch not in ("bert", "roberta", "xlm-roberta"))


def test_non_string_element_is_named_by_index(bert):
    with pytest.raises(TypeError, match=r"documents\[2\] is int"):
        bert.encode_documents(["a", "b", 3])
    with pytest.raises(TypeError, match=r"queries\[0\] is NoneType"):
        bert.encode_queries([None])
    with pytest.raises(TypeError, match="not a single str"):
        bert.encode_documents("just one string")


def test_text_that_is_not_unicode_is_named(bert):
    with pytest.raises(ValueError, match=r"documents\[1\] is not valid Unicode: surrogates not allowed at character 4"):
        bert.encode_documents(["fine", "bad \ud800 x"])
    assert np.isfinite(bert.encode_documents(["nul \x00 bytes \x01", "x" * 50_000])).all()


def test_empty_inputs(bert):
    assert bert.encode_documents([]).shape == (0, 32)
    out = bert.encode_documents([], return_chunks=True)
    assert out.documents.shape == (0, 32) and out.chunks.shape == (0, 32)
    assert bert.encode_queries([]).shape == (0, 32)
    v = bert.encode_documents([""])
    assert np.isfinite(v).all() and abs(np.linalg.norm(v[0]) - 1) < 1e-5


def test_empty_document_without_special_tokens_is_a_zero_vector():
    model, tok, *_ = tiny("qwen2")  # this tokenizer adds no special tokens: an empty text has no tokens
    out = DiceEncoder(model, tok, chunk_size=8).encode_documents(["", "the cat"], return_chunks=True)
    assert np.all(out.documents[0] == 0) and np.isfinite(out.documents).all()
    assert abs(np.linalg.norm(out.documents[1]) - 1) < 1e-5


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(chunk_size=8, overlap=8), r"overlap \(8\) must be smaller than chunk_size \(8\)"),
        (dict(chunk_size=8, overlap=-1), "overlap must be an integer >= 0"),
        (dict(chunk_size=0), "chunk_size must be an integer >= 1"),
        (dict(chunk_size=127), r"chunk_size 127 plus 2 special/prefix tokens is 129 tokens.*allowed: chunk_size <= 126"),
        (dict(pooling="median"), r"unknown pooling 'median'; allowed: mean, cls, last"),
        (dict(aggregation="sum"), r"unknown aggregation 'sum'; allowed: mean, weighted_mean, max, topk_norm, softmax_norm"),
        (dict(aggregation="topk_norm", top_k=0), "top_k must be an integer >= 1"),
        (dict(aggregation="topk_norm", top_k=2.5), "top_k must be an integer >= 1"),
        (dict(aggregation="softmax_norm", temperature=0), "temperature must be a finite number >= 1e-30"),
        (dict(aggregation="softmax_norm", temperature=1e-310), "temperature must be a finite number >= 1e-30"),
        (dict(aggregation="softmax_norm", temperature="x"), "temperature must be a finite number, got 'x'"),
        (dict(aggregation="softmax_norm", temperature=None), "temperature must be a finite number, got None"),
        (dict(max_length=8, query_prefix="a b c d e f g"), "leaves no room for text beside 9 special and query_prefix"),
        (dict(device="gpu"), "device must be a torch device such as 'cpu'"),
        (dict(device="cpu:5"), "a CPU has no devices to number"),
        (dict(strategy="multi"), "unknown strategy"),
        (dict(positions="absolute"), "unknown positions"),
        (dict(attention="sideways"), "unknown attention"),
        (dict(attention_backend="flash_attn"), "not available on cpu"),
        (dict(max_length=1000), "exceeds the model's 128 positions"),
        (dict(max_batch_tokens=0), "max_batch_tokens must be an integer >= 1"),
        # the temperature is recorded whatever the aggregation: NaN made an index refuse its own encoder
        (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
        (dict(temperature=True), "temperature must be a finite number"),
        (dict(max_chunks_per_document=2**63), "max_chunks_per_document must be an integer >= 1 or None"),
        (dict(aggregation="topk_norm", top_k=2**63), "top_k must be an integer >= 1"),
        (dict(chunk_size=np.float64(8)), "chunk_size must be an integer >= 1"),
        (dict(auto_agreement=np.float32("nan")), "auto_agreement must be a cosine in"),
        (dict(dtype="auto", device=" cpu"), "device must be a torch device"),  # was torch's RuntimeError
    ],
)
def test_bad_options_raise_value_error_saying_what_is_allowed(options, match):
    model, tok, *_ = tiny("bert")
    with pytest.raises(ValueError, match=match):
        DiceEncoder(model, tok, **options)


def test_a_temperature_outside_softmax_norm_may_be_any_finite_number():
    """An index or output recorded with temperature=0 (unused by mean) still opens: only NaN and the
    infinities are refused for every aggregation (NaN never equals itself when records are compared)."""
    for t in (0.0, -1.0, 0):
        assert DiceConfig(temperature=t).temperature == float(t)


def test_numpy_values_are_the_plain_ones_and_huge_counts_mean_all():
    """Options from numpy or pandas are the Python values they hold (stored as such: the index and a
    resumed job compare them as recorded); a bool is never a count; 2**63-1 (sys.maxsize) means every
    chunk, as None does; a string is never a switch (cuda_graphs="false" was taken as on)."""
    model, tok, *_ = tiny("bert")
    docs = ["word " * 120, "short text", "x " * 40]
    plain = DiceEncoder(model, tok, chunk_size=8, aggregation="softmax_norm", temperature=0.5).encode_documents(docs)
    enc = DiceEncoder(model, tok, chunk_size=np.int64(8), aggregation="softmax_norm", temperature=np.float32(0.5),
                      normalize=np.True_, max_chunks_per_document=sys.maxsize, max_batch_tokens=np.int32(4096))
    assert type(enc.config.chunk_size) is int and type(enc.config.temperature) is float
    assert enc.config.normalize is True
    np.testing.assert_array_equal(enc.encode_documents(docs), plain)
    top = DiceEncoder(model, tok, chunk_size=8, aggregation="topk_norm", top_k=sys.maxsize).encode_documents(docs)
    mean = DiceEncoder(model, tok, chunk_size=8).encode_documents(docs)
    np.testing.assert_allclose(top, mean, atol=1e-6)
    for bad in (dict(cuda_graphs="false"), dict(cuda_graphs=None), dict(dedup="0"), dict(chunk_size=True)):
        with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
            DiceEncoder(model, tok, **bad)


def test_cuda_graphs_off_cuda_are_refused_before_the_forward_is_compiled(monkeypatch):
    import dice_fast.runner

    def never(*args, **kwargs):
        raise AssertionError("the runner was built (and compiled) before the refusal")

    monkeypatch.setattr(dice_fast.runner.ModelRunner, "__init__", never)
    model, tok, *_ = tiny("bert")
    with pytest.raises(ValueError, match=r"CUDA graphs \(cuda_graphs=True\) need a CUDA device"):
        DiceEncoder(model, tok, cuda_graphs=True, compile="on")


def test_an_encoder_whose_model_another_encoder_moved_refuses_to_run():
    """A second encoder built on the same model object in bfloat16 cast its weights: the first went on
    saying float32 (and keying its chunk cache so) while computing in bfloat16 (1.6e-3 off)."""
    model, tok, *_ = tiny("bert")
    model = copy.deepcopy(model)  # tiny's model is shared by the other tests
    first = DiceEncoder(model, tok, chunk_size=8)
    before = first.encode_documents(["a few words of text"])
    second = DiceEncoder(model, tok, chunk_size=8, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"weights are now bfloat16 on cpu, not the float32 on cpu this encoder"):
        first.encode_documents(["a few words of text"])
    assert np.abs(second.encode_documents(["a few words of text"]) - before).max() > 1e-4  # bf16 weights now


def test_unknown_option_is_a_type_error():
    model, tok, *_ = tiny("bert")
    with pytest.raises(TypeError, match="chunk_sizes"):
        DiceEncoder(model, tok, chunk_sizes=3)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['chunk_sizes'\]"):
        DiceEncoder.from_pretrained(chunk_sizes=3)


def test_config_object_and_repr(bert):
    enc = DiceEncoder(bert.model, bert.tokenizer, config=DiceConfig(chunk_size=8, aggregation="max"))
    text = repr(enc)
    for part in ("device=cpu", "dtype=float32", "attention=sdpa_groups", "aggregation=max", "chunk_size=8"):
        assert part in text
    assert "top_k" not in text and "truncate_dim" not in text  # defaults are not repeated
    other = DiceEncoder(bert.model, bert.tokenizer, chunk_size=8, aggregation="topk_norm", top_k=3, truncate_dim=16,
                        normalize=False, max_chunks_per_document=2, document_prefix="p: ")
    for part in ("top_k=3", "truncate_dim=16", "normalize=False", "max_chunks_per_document=2", "document_prefix='p: '"):
        assert part in repr(other)  # every option that changes the vectors, where it is not the default
    # as resolved: normalize_chunks (the model's Normalize decides it), late chunking's windows, dedup off
    late = DiceEncoder(bert.model, bert.tokenizer, chunk_size=8, strategy="late", dedup=False)
    for part in ("normalize_chunks=False", "window_tokens=128, window_overlap=31", "dedup=False"):
        assert part in repr(late) and "window_tokens" not in text and "dedup" not in text, repr(late)


def test_queries_are_one_window_and_truncation_warns(bert):
    long_query = " ".join(["cat"] * 300)
    with pytest.warns(UserWarning, match=r"1 queries longer than the model window.*queries\[1\] \(300 tokens\)"):
        q = bert.encode_queries(["short", long_query])
    assert q.shape == (2, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bert.encode_queries(["short query"])


def test_return_chunks_spans(bert):
    out = bert.encode_documents(["the cat " * 10, "", "dog"], return_chunks=True)
    assert out.chunk_document.tolist() == [0, 0, 0, 1, 2]
    assert out.chunk_start.tolist() == [0, 8, 16, 0, 0]
    assert out.chunk_end.tolist() == [8, 16, 20, 0, 1]
    assert out.document_tokens.tolist() == [20, 0, 1]
    assert out.chunks.shape == (5, 32)


def test_bundled_model_matches_per_chunk_reference_and_sentence_transformers(minilm):
    texts = ["Dense retrieval squeezes a whole document into a single vector. " * 12, "A short note.", ""]
    out = minilm.encode_documents(texts, return_chunks=True)
    want, _ = reference_encode(minilm.model, minilm.tokenizer, texts, prefix=(101,), suffix=(102,), first_position=0,
                               chunk_size=64, normalize_chunks=True)
    assert minilm.normalize_chunks and minilm.pooling == "mean" and minilm.window == 256
    assert_close(out.documents, want, 1e-5, what="all-MiniLM-L6-v2 documents")
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(default_model_path(), device="cpu")
    queries = ["what does dense retrieval do?", "short"]
    assert_close(minilm.encode_queries(queries), st.encode(queries, convert_to_numpy=True), 1e-5, what="queries vs ST")
    single = DiceEncoder(minilm.model, minilm.tokenizer, model_path=default_model_path(), strategy="single")
    assert_close(single.encode_documents(texts), st.encode(texts, convert_to_numpy=True), 1e-5, what="single vs ST")


def test_dtype_option_casts_the_model():
    model, tok, *_ = tiny("llama")
    import copy

    enc = DiceEncoder(copy.deepcopy(model), tok, chunk_size=8, dtype=torch.bfloat16)
    assert enc.dtype == torch.bfloat16
    base = DiceEncoder(model, tok, chunk_size=8).encode_documents(["the cat sat on the mat " * 5])
    low = enc.encode_documents(["the cat sat on the mat " * 5])
    assert float((base * low).sum()) > 0.99  # cosine of unit vectors


def test_an_explicit_pooling_impl_that_cannot_run_is_refused_when_the_encoder_is_built(monkeypatch):
    """It used to be accepted and fail at the first batch with a RuntimeError."""
    import dice_fast.ops
    from dice_fast.ops import native

    model, tok, *_ = tiny("bert")
    monkeypatch.setattr(native, "is_loaded", lambda: False)
    monkeypatch.setattr(dice_fast.ops, "_BUILD_FAILED", [])  # tried once per process: not by another test

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(native, "build", no_compiler)  # asked for by name, it is built first (the CLI cannot)
    with pytest.raises(ValueError, match=r"pooling_impl='native' cannot run on cpu: the C\+\+ extension did not "
                                         r"build \(no C\+\+ compiler found\)"):
        DiceEncoder(model, tok, pooling_impl="native")
    import dice_fast.ops.triton_pool  # noqa: F401 - its kernels made for the interpreter before the variable goes
    # (made without it, they wanted a GPU driver in every later test of the process: alone, test_engine's)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="pooling_impl='triton' cannot run on cpu: the Triton kernels need"):
        DiceEncoder(model, tok, pooling_impl="triton")


def _st_folder(tmp_path, modules, pooling_config):
    """A model folder with a sentence-transformers pipeline: ``modules`` (type names after the
    Transformer) and the Pooling module's config."""
    model, tok, *_ = tiny("bert")
    copy.deepcopy(model).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    listed = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    for i, kind in enumerate(modules, 1):
        listed.append({"idx": i, "name": str(i), "path": f"{i}_{kind}", "type": f"sentence_transformers.models.{kind}"})
        (tmp_path / f"{i}_{kind}").mkdir()
        if kind == "Pooling":
            (tmp_path / f"{i}_{kind}" / "config.json").write_text(json.dumps(pooling_config))
    (tmp_path / "modules.json").write_text(json.dumps(listed))
    return tmp_path


@pytest.mark.parametrize("pooling_config,found", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode": "mean"}, "mean"),
    ({"pooling_mode_max_tokens": True}, "'max_tokens'"),
    ({"pooling_mode": "max"}, "'max_tokens'"),
    ({"pooling_mode_weightedmean_tokens": True}, "'weightedmean_tokens'"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "'cls_token+mean_tokens'"),
])
def test_sentence_transformers_pooling_is_followed_or_refused(tmp_path, pooling_config, found):
    """A pooling dice_fast does not compute (max, weighted mean, several concatenated) used to become
    mean (or cls) silently; it is now refused until ``pooling`` is chosen explicitly."""
    folder = _st_folder(tmp_path, ["Pooling", "Normalize"], pooling_config)
    if found.startswith("'"):
        with pytest.raises(ValueError, match=f"sentence-transformers pooling is {re.escape(found)}.*pass pooling="):
            DiceEncoder.from_pretrained(folder, device="cpu")
        assert DiceEncoder.from_pretrained(folder, device="cpu", pooling="mean").settings.pooling == "mean"
    else:
        enc = DiceEncoder.from_pretrained(folder, device="cpu")
        assert enc.settings.pooling == found and enc.settings.spec.normalizes


def test_sentence_transformers_modules_not_applied_are_named(tmp_path):
    folder = _st_folder(tmp_path, ["WordWeights", "Pooling", "SpladePooling", "Normalize"],
                        {"pooling_mode_mean_tokens": True})
    with pytest.warns(UserWarning, match=r"has WordWeights \(1_WordWeights\), SpladePooling \(3_SpladePooling\), "
                                         "which dice_fast does not apply"):
        DiceEncoder.from_pretrained(folder, device="cpu")


def test_a_token_the_model_has_no_embedding_for_is_named():
    """A tokenizer given tokens after its model was saved (no resize_token_embeddings) made the forward
    fail with torch's bare IndexError "index out of range in self"."""
    model, tok, *_ = tiny("bert")
    tok = copy.deepcopy(tok)
    tok.add_tokens(["zzzunseen"])
    enc = DiceEncoder(model, tok, chunk_size=8)
    with pytest.raises(ValueError, match=r"documents\[1\] holds token id 56, beyond the model's 56 embeddings"):
        enc.encode_documents(["a b c", "hello zzzunseen world"])
    with pytest.raises(ValueError, match=r"queries\[0\] holds token id 56"):
        enc.encode_queries(["zzzunseen"])
    with pytest.raises(ValueError, match="document_prefix .*beyond the model's 56 embeddings"):
        DiceEncoder(model, tok, document_prefix="zzzunseen: ")
