"""A model folder as sentence-transformers publishes it, followed or refused, checked against
sentence-transformers itself run on each chunk's exact token ids: the Dense modules after its pooling
(`dice_fast.head`) on every chunk and query vector and every path that pools chunks, ``do_lower_case``,
a Pooling that leaves the prompt out (every chunk pooled after it), T5 checkpoints (their encoder alone) and the layout of
sentence-transformers 1 (the transformer in ``0_Transformer/``)."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import warnings

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from dice_fast.bench.baselines import encode_padded_naive
from dice_fast.errors import DiceError, ModelError
from helpers import assert_close
from oracle import corpus
from tiny_models import tiny, tiny_subword

st_models = pytest.importorskip("sentence_transformers.models")
SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer

HEAD_WIDTH = 16
TOL = 2e-6  # float32: the same linears, pooling sums in another order


def _heads(hidden: int, seed: int = 7) -> list:
    """Three Dense modules of the kinds saved models hold: a Tanh projection, a residual GELU block,
    a projection without bias whose residual is projected too."""
    torch.manual_seed(seed)
    heads = [st_models.Dense(hidden, 24, activation_function=torch.nn.Tanh()),
             st_models.Dense(24, 24, activation_function=torch.nn.GELU(), use_residual=True),
             st_models.Dense(24, HEAD_WIDTH, bias=False, activation_function=torch.nn.Identity(), use_residual=True)]
    with torch.no_grad():
        for h in heads:
            for p in h.parameters():
                p.normal_(0, 0.3)
    return heads


def st_folder(tmp_path, *, heads=None, normalize=True, safe=True, name="st", pooling=None):
    """A saved sentence-transformers pipeline: tiny BERT, ``pooling`` (default mean), ``heads`` (default
    `_heads`), Normalize. Returns (folder, the SentenceTransformer loaded back from it)."""
    model, tok, *_ = tiny("bert")
    hf = tmp_path / f"{name}-hf"
    copy.deepcopy(model).save_pretrained(hf)
    tok.save_pretrained(hf)
    modules = [st_models.Transformer(str(hf), max_seq_length=64), pooling or st_models.Pooling(32, "mean"),
               *(_heads(32) if heads is None else heads)]
    modules += [st_models.Normalize()] if normalize else []
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / name), safe_serialization=safe)
    return tmp_path / name, SentenceTransformer(str(tmp_path / name), device="cpu", local_files_only=True).eval()


def st_chunk_vectors(st, plan) -> np.ndarray:
    """(n_chunks, width) the pipeline run by sentence-transformers on each chunk's wrapped token ids."""
    rows = []
    with torch.inference_mode():
        for c in range(plan.n_chunks):
            ids = torch.as_tensor(plan.chunk_ids(c), dtype=torch.long)[None]
            rows.append(st({"input_ids": ids, "attention_mask": torch.ones_like(ids)})["sentence_embedding"][0])
    return torch.stack(rows).numpy()


def test_chunk_documents_and_queries_are_the_pipelines_own(tmp_path):
    folder, st = st_folder(tmp_path)
    enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8)
    assert enc.dim == HEAD_WIDTH and enc.settings.normalize_chunks
    assert "head=[Dense 32->24 Tanh, Dense 24->24 GELU +residual, Dense 24->16 Identity +residual]" in repr(enc)
    texts = corpus(seed=3, longest=60)
    out = enc.encode_documents(texts, return_chunks=True)
    want = st_chunk_vectors(st, enc.plan(texts))
    assert out.chunks.shape == want.shape == (len(want), HEAD_WIDTH)
    assert_close(out.chunks, want, TOL, what="chunk vectors against sentence-transformers per chunk")
    docs = np.stack([want[out.chunk_document == d].astype(np.float64).mean(0) for d in range(len(texts))])
    assert_close(out.documents, docs / np.linalg.norm(docs, axis=1, keepdims=True), TOL, what="mean of chunks")
    queries = ["the cat sat on a mat", "red house under blue sky", "what is short"]
    assert_close(enc.encode_queries(queries), st.encode(queries, convert_to_numpy=True), TOL, what="queries")


@pytest.mark.parametrize("options", [
    {"strategy": "late", "window_tokens": 40},
    {"attention_backend": "padded"},
    {"aggregation": "topk_norm", "top_k": 2, "max_chunks_per_document": 3},
    {"truncate_dim": 8, "normalize_chunks": True},
], ids=["late", "padded", "topk", "truncated"])
def test_every_path_runs_the_head_on_its_pooled_chunks(tmp_path, options):
    """The same transformer without the Dense modules, its chunks run through sentence-transformers'
    own Dense modules afterwards: what the engine with the head gives, on each path that pools chunks."""
    heads = _heads(32)
    folder, _ = st_folder(tmp_path, heads=heads, normalize=False)
    bare, _ = st_folder(tmp_path, heads=[], normalize=False, name="bare")
    texts = corpus(seed=5, longest=90)
    got = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8, **options).encode_documents(
        texts, return_chunks=True)
    same = {k: v for k, v in options.items() if k not in ("truncate_dim", "normalize_chunks")}
    pooled = DiceEncoder.from_pretrained(bare, device="cpu", chunk_size=8, normalize_chunks=False, **same)
    raw = torch.as_tensor(pooled.encode_documents(texts, return_chunks=True).chunks)
    with torch.inference_mode():
        for h in heads:
            raw = h({"sentence_embedding": raw})["sentence_embedding"]
    want = raw.numpy()
    if options.get("normalize_chunks"):
        want = want / np.linalg.norm(want, axis=1, keepdims=True)
    if "truncate_dim" in options:
        want = want[:, : options["truncate_dim"]]
        want = want / np.linalg.norm(want, axis=1, keepdims=True)
    assert got.chunks.shape == want.shape
    assert_close(got.chunks, want, TOL, what=f"chunks with the head, {options}")


def test_weights_saved_as_pytorch_model_bin_are_read_too(tmp_path):
    folder, st = st_folder(tmp_path, safe=False)
    assert not list(folder.glob("2_Dense/*.safetensors")) and (folder / "2_Dense" / "pytorch_model.bin").is_file()
    queries = ["hello world", "the old man and the river"]
    got = DiceEncoder.from_pretrained(folder, device="cpu").encode_queries(queries)
    assert_close(got, st.encode(queries, convert_to_numpy=True), TOL, what="queries, weights from .bin")


def test_the_chunk_cache_keeps_heads_apart(tmp_path):
    """Two pipelines with one transformer and Dense modules of the same shapes but other weights share
    a persistent cache: neither is ever served the other's chunk vectors."""
    cache = tmp_path / "cache"
    a, _ = st_folder(tmp_path, heads=_heads(32, seed=1), name="a")
    b, st_b = st_folder(tmp_path, heads=_heads(32, seed=2), name="b")
    texts = corpus(seed=9, longest=40)
    first = DiceEncoder.from_pretrained(a, device="cpu", chunk_size=8, cache=cache).encode_documents(texts)
    enc_b = DiceEncoder.from_pretrained(b, device="cpu", chunk_size=8, cache=cache)
    out = enc_b.encode_documents(texts, return_chunks=True)
    assert_close(out.chunks, st_chunk_vectors(st_b, enc_b.plan(texts)), TOL, what="b on a's cache")
    assert np.abs(out.documents - first).max() > 0.1
    again = DiceEncoder.from_pretrained(b, device="cpu", chunk_size=8, cache=cache).encode_documents(texts)
    np.testing.assert_array_equal(again, out.documents)  # b's own entries are hits: the same vectors


def test_truncate_dim_is_bounded_by_the_heads_width(tmp_path):
    folder, _ = st_folder(tmp_path)
    with pytest.raises(DiceError, match=f"truncate_dim.*{HEAD_WIDTH}"):
        DiceEncoder.from_pretrained(folder, device="cpu", truncate_dim=24)  # the transformer is 32 wide


def _edit_config(folder, **changes):
    path = folder / "2_Dense" / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage,message", [
    (lambda f: (f / "2_Dense" / "config.json").unlink(), r"2_Dense/config\.json: cannot read"),
    (lambda f: _edit_config(f, activation_function="os.system"), r"activation_function 'os\.system' is not a torch\.nn"),
    (lambda f: _edit_config(f, activation_function="torch.nn.modules.linear.Linear"), "cannot be made without arguments"),
    (lambda f: _edit_config(f, in_features=31), "in_features 31, but the vectors it follows are 32 wide"),
    (lambda f: _edit_config(f, out_features=25), r"linear\.weight must be a floating-point tensor of shape \(25, 32\)"),
    (lambda f: (f / "2_Dense" / "model.safetensors").write_bytes(b"not a tensor file"), "cannot read the Dense module's weights"),
    (lambda f: (f / "2_Dense" / "model.safetensors").unlink(), "has no model.safetensors or pytorch_model.bin"),
], ids=["no-config", "foreign-activation", "activation-with-arguments", "in-features", "shape", "damaged", "no-weights"])
def test_a_head_it_cannot_read_exactly_is_refused_by_name(tmp_path, damage, message):
    folder, _ = st_folder(tmp_path)
    damage(folder)
    with pytest.raises(ModelError, match=message):
        DiceEncoder.from_pretrained(folder, device="cpu")


def test_dense_modules_not_on_the_pooled_vector_are_named_not_applied(tmp_path):
    """A Dense that reads token embeddings, or one outside the model folder, is not the head: warned, and
    the vectors are the pooled ones."""
    folder, _ = st_folder(tmp_path, heads=[st_models.Dense(32, 32)])
    listed = json.loads((folder / "modules.json").read_text())
    _edit_config(folder, module_input_name="token_embeddings")
    with pytest.warns(UserWarning, match=r"has Dense \(2_Dense\), which dice_fast does not apply"):
        enc = DiceEncoder.from_pretrained(folder, device="cpu")
    assert enc.settings.head is None and enc.dim == 32
    _edit_config(folder, module_input_name="sentence_embedding")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DiceEncoder.from_pretrained(folder, device="cpu").settings.head is not None
    shutil.copytree(folder / "2_Dense", tmp_path / "outside")  # weights are read from inside the folder only
    listed[2]["path"] = "../outside"
    (folder / "modules.json").write_text(json.dumps(listed))
    with pytest.warns(UserWarning, match=r"has Dense \(\.\./outside\), which dice_fast does not apply"):
        assert DiceEncoder.from_pretrained(folder, device="cpu").settings.head is None


def _layer_norm(width: int, seed: int) -> "st_models.LayerNorm":
    norm = st_models.LayerNorm(width)
    torch.manual_seed(seed)
    with torch.no_grad():
        norm.norm.weight.normal_(1, 0.5)
        norm.norm.bias.normal_(0, 0.5)
    return norm


def test_layer_norms_and_a_normalize_between_modules_are_the_pipelines_own(tmp_path):
    """Pooling, Dense, LayerNorm, Normalize, Dense, LayerNorm, Normalize: every module on the pooled vector
    runs on each chunk and query vector (the last Normalize is normalize_chunks), as sentence-transformers
    runs them; and a Normalize right after the pooling, then a Dense, likewise."""
    torch.manual_seed(11)
    first, second = (st_models.Dense(32, 24), st_models.Dense(24, HEAD_WIDTH, activation_function=torch.nn.Identity()))
    mid = [first, _layer_norm(24, 1), st_models.Normalize(), second, _layer_norm(HEAD_WIDTH, 2)]
    folder, st = st_folder(tmp_path, heads=mid)
    enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8)
    assert "head=[Dense 32->24 Tanh, LayerNorm 24, Normalize, Dense 24->16 Identity, LayerNorm 16]" in repr(enc)
    assert enc.dim == HEAD_WIDTH and enc.settings.normalize_chunks
    texts = corpus(seed=4, longest=60)
    out = enc.encode_documents(texts, return_chunks=True)
    assert_close(out.chunks, st_chunk_vectors(st, enc.plan(texts)), TOL, what="chunks through LayerNorms and Normalize")
    queries = ["the cat sat on a mat", "what is short"]
    assert_close(enc.encode_queries(queries), st.encode(queries, convert_to_numpy=True), TOL, what="queries")

    folder, st = st_folder(tmp_path, heads=[st_models.Normalize(), st_models.Dense(32, 32)], normalize=False,
                           name="normalize-first")
    enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8, normalize_chunks=True)
    assert "head=[Normalize, Dense 32->32 Tanh]" in repr(enc)
    assert not DiceEncoder.from_pretrained(folder, device="cpu").settings.normalize_chunks  # the pipeline ends in Dense
    out = enc.encode_documents(texts, return_chunks=True)
    want = st_chunk_vectors(st, enc.plan(texts))
    assert_close(out.chunks, want / np.linalg.norm(want, axis=1, keepdims=True), TOL, what="Normalize, Dense")


def test_a_head_digest_keys_every_module_and_keeps_dense_heads_keys(tmp_path):
    """The chunk cache's key of a head: another LayerNorm weight, or a Normalize more, is another key;
    a head of Dense modules keeps the key it had before other modules joined (its cached vectors still hit)."""
    import hashlib

    from dice_fast.head import load_head

    folder, _ = st_folder(tmp_path, heads=[*_heads(32), _layer_norm(HEAD_WIDTH, 3)])
    names = [m["path"] for m in json.loads((folder / "modules.json").read_text())[2:6]]
    dense = [("Dense", str(folder / n)) for n in names[:3]]
    norm = ("LayerNorm", str(folder / names[3]))
    old = hashlib.sha256()  # the digest as dice_fast computed it for Dense heads alone
    for d in load_head(dense, 32).layers:
        old.update(f"{d.in_features}|{d.out_features}|{d.activation_name}|".encode())
        for t in (d.weight, d.bias, d.residual):
            old.update(t.numpy().tobytes() if isinstance(t, torch.Tensor) else repr(t).encode())
    assert load_head(dense, 32).digest == old.hexdigest()
    digests = {load_head(dense, 32).digest, load_head([*dense, norm], 32).digest,
               load_head([*dense, ("Normalize", ""), norm], 32).digest}
    other, _ = st_folder(tmp_path, heads=[*_heads(32), _layer_norm(HEAD_WIDTH, 4)], name="other")
    digests.add(load_head([*dense, ("LayerNorm", str(other / names[3]))], 32).digest)
    assert len(digests) == 4


def _edit_norm(folder, name, **changes):
    path = folder / name / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("damage,message", [
    (lambda f, n: _edit_norm(f, n, dimension="wide"), "a LayerNorm module needs an integer dimension"),
    (lambda f, n: _edit_norm(f, n, dimension=17), "dimension 17, but the vectors it follows are 16 wide"),
    (lambda f, n: (f / n / "config.json").write_text("[1]"), "a LayerNorm module's configuration must be a JSON object"),
    (lambda f, n: (f / n / "model.safetensors").unlink(), "the LayerNorm module has no model.safetensors"),
], ids=["dimension-type", "dimension", "config", "no-weights"])
def test_a_layer_norm_it_cannot_read_exactly_is_refused_by_name(tmp_path, damage, message):
    folder, _ = st_folder(tmp_path, heads=[*_heads(32), _layer_norm(HEAD_WIDTH, 5)])
    name = json.loads((folder / "modules.json").read_text())[5]["path"]
    damage(folder, name)
    with pytest.raises(ModelError, match=message):
        DiceEncoder.from_pretrained(folder, device="cpu")


def test_a_layer_norm_before_the_pooling_is_named_not_applied(tmp_path):
    folder, _ = st_folder(tmp_path, heads=[])
    listed = json.loads((folder / "modules.json").read_text())
    (folder / "1_LayerNorm").mkdir()
    _layer_norm(32, 6).save(str(folder / "1_LayerNorm"))
    listed.insert(1, {"idx": 9, "name": "9", "path": "1_LayerNorm",
                      "type": "sentence_transformers.models.LayerNorm"})
    (folder / "modules.json").write_text(json.dumps(listed))
    with pytest.warns(UserWarning, match=r"has LayerNorm \(1_LayerNorm\), which dice_fast does not apply"):
        assert DiceEncoder.from_pretrained(folder, device="cpu").settings.head is None


def test_do_lower_case_lowercases_every_text_first_as_sentence_transformers_does(tmp_path):
    """An older folder's ``do_lower_case``: every text lowercased before tokenizing, its spans in the text
    as given. The tokenizer is the tiny word-level one without its Lowercase: "The" is [UNK] to it."""
    model, tok, *_ = tiny("bert")
    cased = copy.deepcopy(tok)
    cased.backend_tokenizer.normalizer = None
    texts = ["The Cat sat on a mat. The RED house", "the cat sat on a mat. the red house"]
    hf = tmp_path / "hf"
    copy.deepcopy(model).save_pretrained(hf)
    cased.save_pretrained(hf)
    folder = tmp_path / "st"
    st_modules = [st_models.Transformer(str(hf), max_seq_length=64, do_lower_case=True), st_models.Pooling(32, "mean")]
    SentenceTransformer(modules=st_modules, device="cpu").save(str(folder))
    # as sentence-transformers 5 and before saved it: the flag in the config, the tokenizer cased
    # (version 6 bakes a Lowercase normalizer into the saved tokenizer instead, and still reads the flag)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    cased.save_pretrained(folder)
    st = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=6)
    out = enc.encode_documents(texts, return_chunks=True)
    np.testing.assert_array_equal(out.documents[0], out.documents[1])
    want = st.encode(texts[:1], convert_to_numpy=True)  # no Normalize module: the engine's normalize=True does it
    assert_close(enc.encode_queries(texts[:1]), want / np.linalg.norm(want, axis=1, keepdims=True), TOL, what="lowercased")
    first = out.chunk_document == 0
    spans = [texts[0][a:b] for a, b in zip(out.chunk_start_char[first], out.chunk_end_char[first])]
    assert spans[0].startswith("The Cat") and spans[-1].endswith("RED house")  # the text as given
    plain = DiceEncoder(model, cased, chunk_size=6)  # no folder, no do_lower_case: "The" is [UNK]
    assert np.abs(plain.encode_documents(texts[:1]) - out.documents[:1]).max() > 1e-3
    assert cased.backend_tokenizer.normalizer is None  # the caller's tokenizer is left as it was


def _prompt_length_seen(st, prompt: str) -> int:
    """The ``prompt_length`` sentence-transformers hands its Pooling when it encodes a text after ``prompt``."""
    seen = {}
    hook = st[1].register_forward_pre_hook(lambda module, args: seen.update(n=args[0].get("prompt_length")))
    try:
        st.encode(["the cat"], prompt=prompt)
    finally:
        hook.remove()
    return int(seen["n"])


def _st_after_prompt(st, plan, prompt_length: int | None) -> np.ndarray:
    """(n_chunks, width) sentence-transformers on each wrapped chunk, its Pooling told ``prompt_length``."""
    rows = []
    with torch.inference_mode():
        for c in range(plan.n_chunks):
            ids = torch.as_tensor(plan.chunk_ids(c), dtype=torch.long)[None]
            features = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if prompt_length is not None:
                features["prompt_length"] = prompt_length
            rows.append(st(features)["sentence_embedding"][0])
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_a_pooling_that_leaves_the_prompt_out_pools_every_chunk_after_it(tmp_path, mode):
    """INSTRUCTOR-like (a Pooling with include_prompt false, Dense, Normalize): every chunk is wrapped with the
    prompt and pooled from the token after it, as sentence-transformers pools a text after its prompt."""
    folder, st = st_folder(tmp_path, pooling=st_models.Pooling(32, mode, include_prompt=False))
    doc_prompt, query_prompt = "represent the document: ", "query: "
    enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8, document_prefix=doc_prompt,
                                      query_prefix=query_prompt)
    assert f"pooling={mode} (prompt left out)" in repr(enc)
    texts = corpus(seed=8, longest=60)
    out = enc.encode_documents(texts, return_chunks=True)
    plan = enc.plan(texts)
    k = _prompt_length_seen(st, doc_prompt)
    assert k == len(plan.prefix) and plan.unpooled == k  # [CLS] and the prompt's words
    assert_close(out.chunks, _st_after_prompt(st, plan, k), TOL, what=f"{mode} chunks after the prompt")
    assert np.abs(out.chunks - _st_after_prompt(st, plan, None)).max() > 1e-2  # the prompt pooled is another vector
    queries = ["the cat sat on a mat", "red house under blue sky", "what is short"]
    assert_close(enc.encode_queries(queries), st.encode(queries, prompt=query_prompt, convert_to_numpy=True), TOL,
                 what="queries after their prompt")
    short = [t for t in texts if len(enc.tokenize([t]).ids) <= 20][:3]  # one chunk each: sentence-transformers whole
    whole = DiceEncoder.from_pretrained(folder, device="cpu", document_prefix=doc_prompt)
    assert_close(whole.encode_documents(short), st.encode(short, prompt=doc_prompt, convert_to_numpy=True), TOL,
                 what="one-chunk documents")
    bare = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8)  # no prompt: nothing is left out
    assert bare.plan(texts).unpooled == 0
    assert_close(bare.encode_documents(texts, return_chunks=True).chunks, st_chunk_vectors(st, bare.plan(texts)), TOL,
                 what="no prompt")


@pytest.mark.parametrize("arch, kind", [("xlm-roberta", "unigram"), ("llama", "bpe")])
def test_the_prompt_left_out_is_sentence_transformers_count_with_subword_tokenizers(tmp_path, arch, kind):
    """SentencePiece keeps a prompt's trailing space as a token of its own ("▁"), byte-level BPE too ("Ġ"),
    so sentence-transformers' prompt_length (the prompt tokenized alone) counts one token more than the
    prompt's ids before a text: the count is its own, and the vectors are its own."""
    model, tok, *_ = tiny_subword(arch, kind)
    copy.deepcopy(model).save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    modules = [st_models.Transformer(str(tmp_path / "hf"), max_seq_length=64),
               st_models.Pooling(model.config.hidden_size, "mean", include_prompt=False)]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu", local_files_only=True).eval()
    prompt = "passage: "
    enc = DiceEncoder.from_pretrained(tmp_path / "st", device="cpu", query_prefix=prompt, normalize=False)
    prefix = enc.settings.query_text_prefix
    assert prefix.prompt_length == _prompt_length_seen(st, prompt) == len(tok(prompt)["input_ids"]) - (kind == "unigram")
    queries = ["the cat sat on the mat", "what is short", "passage: again"]
    assert_close(enc.encode_queries(queries), st.encode(queries, prompt=prompt, convert_to_numpy=True), TOL,
                 what=f"{kind} queries after their prompt")


def test_a_prompt_left_out_on_every_path_that_pools_chunks(tmp_path, ov_cache):
    """The same chunks left out of the same prompt on the padded path, in the benchmark's baseline, on OpenVINO (which pools each
    dense row from the token after the prompt), with the chunk cache (whose
    entries of the model pooling its prompt never serve it), under weighted_mean (chunks weighted by
    the tokens pooled) and late chunking (a chunk pools its own text; an empty text's window, all
    but the prompt)."""
    pooling = st_models.Pooling(32, "mean", include_prompt=False)
    folder, st = st_folder(tmp_path, heads=[], normalize=False, pooling=pooling)
    pooled, _ = st_folder(tmp_path, heads=[], normalize=False, name="pooled")  # the same weights, prompt pooled
    prompt = {"document_prefix": "represent the document: "}
    texts = corpus(seed=9, longest=60)
    enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8, **prompt)
    want = enc.encode_documents(texts, return_chunks=True)
    padded = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8, attention_backend="padded", **prompt)
    assert_close(padded.encode_documents(texts, return_chunks=True).chunks, want.chunks, TOL, what="padded")
    assert_close(encode_padded_naive(enc, texts, batch_size=5), want.documents, TOL, what="the benchmark's baseline")
    if importlib.util.find_spec("openvino") is not None:
        ov = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8, runtime="openvino", **prompt)
        assert_close(ov.encode_documents(texts, return_chunks=True).chunks, want.chunks, 1e-5, what="OpenVINO")
    cache = tmp_path / "cache"
    other = DiceEncoder.from_pretrained(pooled, device="cpu", chunk_size=8, cache=cache, **prompt)
    other_chunks = other.encode_documents(texts, return_chunks=True).chunks
    cached = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8, cache=cache, **prompt)
    for _ in range(2):  # computed beside the other model's entries, then from its own
        assert_close(cached.encode_documents(texts, return_chunks=True).chunks, want.chunks, TOL, what="cache")
    assert np.abs(other_chunks - want.chunks).max() > 1e-2
    weighted = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8, aggregation="weighted_mean", **prompt)
    plan = weighted.plan(texts)
    weights = plan.chunks.length + len(plan.suffix)  # the tokens after the prompt
    np.testing.assert_array_equal(plan.chunk_weights, weights)
    docs = np.stack([(want.chunks[want.chunk_document == d] * weights[want.chunk_document == d, None]).sum(0)
                     for d in range(len(texts))])
    assert_close(weighted.encode_documents(texts), docs / np.linalg.norm(docs, axis=1, keepdims=True), TOL,
                 what="weighted_mean")
    late = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8, strategy="late", window_tokens=40, **prompt)
    texts = [*texts, ""]
    got = late.encode_documents(texts, return_chunks=True).chunks
    same = DiceEncoder.from_pretrained(pooled, device="cpu", chunk_size=8, strategy="late", window_tokens=40,
                                       **prompt).encode_documents(texts, return_chunks=True).chunks
    text = late.plan(texts).chunks.length > 0
    assert (~text).sum() >= 1 and not text[-1]
    assert_close(got[text], same[text], TOL, what="late chunks of text")  # their own tokens, never the prompt
    empty = _st_after_prompt(st, DiceEncoder.from_pretrained(folder, device="cpu", **prompt).plan([""]), len(plan.prefix))
    assert_close(got[~text], np.repeat(empty, (~text).sum(), 0), TOL, what="late: an empty text's window after the prompt")


def test_a_t5_folder_runs_its_encoder_as_sentence_transformers_does(tmp_path):
    """A T5 checkpoint (encoder and decoder, as GTR-T5 and sentence-T5 are published) with a
    sentence-T5-like pipeline (mean, Dense without bias or activation, Normalize): its encoder alone runs,
    as sentence-transformers loads it (AutoModel's T5Model wanted decoder inputs and failed inside
    transformers); the T5Model itself is refused by name."""
    import transformers

    model, tok, *_ = tiny("t5-encoder")
    config = copy.deepcopy(model.config)
    config.is_encoder_decoder = True
    full = transformers.T5Model(config)
    full.shared.load_state_dict(model.shared.state_dict())
    full.encoder.load_state_dict(model.encoder.state_dict())
    full.save_pretrained(tmp_path / "t5")
    tok.save_pretrained(tmp_path / "t5")
    torch.manual_seed(3)
    dense = st_models.Dense(32, HEAD_WIDTH, bias=False, activation_function=torch.nn.Identity())
    modules = [st_models.Transformer(str(tmp_path / "t5"), max_seq_length=64), st_models.Pooling(32, "mean"), dense,
               st_models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu", local_files_only=True).eval()
    for folder in (tmp_path / "t5", tmp_path / "st"):  # the published checkpoint, and the pipeline's own save
        enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8)
        assert type(enc.model).__name__ == "T5EncoderModel"
    texts = corpus(seed=4, longest=50)
    out = enc.encode_documents(texts, return_chunks=True)
    assert_close(out.chunks, st_chunk_vectors(st, enc.plan(texts)), TOL, what="sentence-T5-like chunks")
    with pytest.raises(ModelError, match="T5Model is an encoder-decoder model; dice_fast embeds with its encoder"):
        DiceEncoder(full, tok)


def test_a_folder_saved_by_sentence_transformers_1_with_its_transformer_in_a_subfolder(tmp_path):
    """The layout sentence-transformers 1 wrote (the transformer, its tokenizer and sentence_bert_config.json
    in ``0_Transformer/``; LaBSE-like: cls pooling, Dense, Normalize) loads from the folder, follows its
    pipeline, and records the folder, not the subfolder, as the model (an index restores it from there)."""
    folder, _ = st_folder(tmp_path, pooling=st_models.Pooling(32, "cls"))
    sub = folder / "0_Transformer"
    sub.mkdir()
    for f in list(folder.iterdir()):
        if f.is_file() and f.name not in ("modules.json", "config_sentence_transformers.json", "README.md"):
            f.rename(sub / f.name)
    (sub / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": False}))
    listed = json.loads((folder / "modules.json").read_text())
    listed[0]["path"] = "0_Transformer"
    (folder / "modules.json").write_text(json.dumps(listed))
    assert not (folder / "config.json").exists()
    st = SentenceTransformer(str(folder), device="cpu", local_files_only=True).eval()  # which reads it too
    enc = DiceEncoder.from_pretrained(folder, device="cpu", chunk_size=8)
    assert enc.pooling == "cls" and enc.window == 40 and enc.dim == HEAD_WIDTH and enc.spec.name == str(folder)
    texts = corpus(seed=6, longest=50)
    out = enc.encode_documents(texts, return_chunks=True)
    assert_close(out.chunks, st_chunk_vectors(st, enc.plan(texts)), TOL, what="subfolder layout")
    listed[0]["path"] = "../elsewhere"  # a modules.json may not point outside its folder
    (folder / "modules.json").write_text(json.dumps(listed))
    with pytest.raises(ModelError, match="is not a model folder"):
        DiceEncoder.from_pretrained(folder, device="cpu")


@pytest.mark.parametrize("name", ["sentence_bert_config.json", "modules.json", "config_sentence_transformers.json"])
def test_a_sentence_transformers_file_of_another_json_type_is_read_as_absent(tmp_path, name):
    """A JSON list where an object is due (or an object where modules.json's list is) raised AttributeError
    from inside the model facts; such a file is now read as absent, as an unreadable one is."""
    folder, _ = st_folder(tmp_path, heads=[], normalize=False)
    (folder / name).write_text(json.dumps({"a": 1} if name == "modules.json" else [1, 2]))
    enc = DiceEncoder.from_pretrained(folder, device="cpu")
    assert enc.dim == 32 and enc.settings.head is None
