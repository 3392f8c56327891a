"""Benchmark inputs: corpus length profiles, documents of real prose cut to token counts, a
self-contained word tokenizer and random-weight models (speed only, no download)."""

from __future__ import annotations

import numpy as np

from ..data import prose, prose_documents as make_corpus  # noqa: F401  (re-exported)

CORPORA = ("mixed", "short", "long")
RANDOM_MODELS = {
    # BERT-base-size encoder, a 1.5B Qwen2-style decoder (GQA) and ModernBERT-base, random weights, for speed only
    "bert-base": ("BertConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                     intermediate_size=3072, max_position_embeddings=512)),
    "qwen2-1.5b": ("Qwen2Config", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                       num_key_value_heads=2, intermediate_size=8960,
                                       max_position_embeddings=32768)),
    # ModernBERT-base: local attention of 128 tokens on two layers of three (a window inside 512-token chunks)
    "modernbert-base": ("ModernBertConfig", dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                                                 intermediate_size=1152, local_attention=128,
                                                 global_attn_every_n_layers=3, max_position_embeddings=8192,
                                                 pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2,
                                                 eos_token_id=3)),
}


def corpus_lengths(kind: str, n_docs: int, seed: int = 0, longest: int = 32768) -> np.ndarray:
    """(n_docs,) target token counts: ``mixed`` (70% 32-512, 25% 512-4k, 5% 4k-``longest``,
    log-uniform in each band), ``short`` (32-256) or ``long`` (4k-``longest``)."""
    if kind not in CORPORA:
        raise ValueError(f"unknown corpus {kind!r}; allowed: {', '.join(CORPORA)}")
    rng = np.random.default_rng(seed)

    def band(lo, hi, n):
        return np.exp(rng.uniform(np.log(lo), np.log(max(hi, lo + 1)), n)).astype(np.int64)

    if kind == "short":
        return band(32, 256, n_docs)
    if kind == "long":
        return band(4096, longest, n_docs)
    pick = rng.choice(3, size=n_docs, p=[0.70, 0.25, 0.05])
    out = np.empty(n_docs, dtype=np.int64)
    for i, (lo, hi) in enumerate(((32, 512), (512, 4096), (4096, longest))):
        out[pick == i] = band(lo, hi, int((pick == i).sum()))
    return out


def word_tokenizer():
    """A self-contained fast tokenizer (words of the bundled prose, CLS/SEP wrapping) for random models."""
    import re

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(re.findall(r"\w+|[^\w\s]", prose().lower())))
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", model_max_length=10**30)


def random_model(name: str, device, dtype):
    """(model, tokenizer) of a `RANDOM_MODELS` architecture with random weights, built on ``device``
    (a ``torch.device``) in ``dtype`` (a ``torch.dtype``)."""
    import torch
    import transformers

    if name not in RANDOM_MODELS:
        raise ValueError(f"unknown random model {name!r}; allowed: {', '.join(RANDOM_MODELS)}")
    tokenizer = word_tokenizer()
    cls_name, kwargs = RANDOM_MODELS[name]
    config = getattr(transformers, cls_name)(vocab_size=len(tokenizer), **kwargs)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.AutoModel.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False), tokenizer
