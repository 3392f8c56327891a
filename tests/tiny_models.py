"""Tiny random-weight models of every supported architecture, with tokenizers of known wrapping.

The tokenizers are word-level over a small fixed vocabulary (so a text of n vocabulary words is
exactly n tokens) with a post-processor of each family's kind (CLS/SEP, BOS only, EOS only, none):
the expected special tokens are known constants the reference uses directly instead of asking
dice_fast. Nothing here needs a model package, so the GPU machine can run these tests too.
"""

from __future__ import annotations

import functools

import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from tokenizers.processors import TemplateProcessing

WORDS = ("the cat sat on a mat and dog ran to big red house with tree under blue sky of sun "
         "day night green old new man woman boy girl car road city river water fire passage query "
         "hello world what is short one alpha beta gamma delta note").split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
VOCAB = {w: i for i, w in enumerate(SPECIALS + sorted(set(WORDS)) + [":", ".", ",", "?"])}
CLS, SEP = VOCAB["[CLS]"], VOCAB["[SEP]"]

# name -> (config class, config kwargs, template prefix ids, template suffix ids, first position)
_SMALL = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
ARCHS = {
    "bert": ("BertConfig", dict(_SMALL, max_position_embeddings=128), (CLS,), (SEP,), 0),
    "roberta": ("RobertaConfig", dict(_SMALL, max_position_embeddings=130, pad_token_id=1), (CLS,), (SEP,), 2),
    "xlm-roberta": ("XLMRobertaConfig", dict(_SMALL, max_position_embeddings=130, pad_token_id=1), (CLS,), (SEP,), 2),
    "llama": ("LlamaConfig", dict(_SMALL, max_position_embeddings=256, num_key_value_heads=4), (CLS,), (), 0),
    "mistral": ("MistralConfig", dict(_SMALL, max_position_embeddings=256, num_key_value_heads=2, sliding_window=None), (), (SEP,), 0),
    "qwen2": ("Qwen2Config", dict(_SMALL, max_position_embeddings=256, num_key_value_heads=2), (), (), 0),
    "qwen3": ("Qwen3Config", dict(_SMALL, max_position_embeddings=256, num_key_value_heads=2, head_dim=8), (), (SEP,), 0),
}


def make_tokenizer(prefix: tuple[int, ...], suffix: tuple[int, ...]):
    """A fast word-level tokenizer over `VOCAB` that adds ``prefix``/``suffix`` as special tokens."""
    base = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    base.normalizer = normalizers.Lowercase()
    base.pre_tokenizer = pre_tokenizers.Whitespace()
    names = {CLS: "[CLS]", SEP: "[SEP]"}
    single = " ".join([names[i] for i in prefix] + ["$A"] + [names[i] for i in suffix])
    base.post_processor = TemplateProcessing(
        single=single, special_tokens=[(names[i], i) for i in sorted(set(prefix) | set(suffix))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=base, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]",
        model_max_length=10**30,
    )


@functools.lru_cache(maxsize=None)
def tiny(arch: str):
    """(model float32 eval on CPU, tokenizer, prefix ids, suffix ids, first position) for ``arch``."""
    cls_name, kwargs, prefix, suffix, first = ARCHS[arch]
    config = getattr(transformers, cls_name)(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    model = transformers.AutoModel.from_config(config).eval().requires_grad_(False)
    # random-init std 0.02 makes every token look alike; widen the weights so chunks differ visibly
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model, make_tokenizer(prefix, suffix), prefix, suffix, first
