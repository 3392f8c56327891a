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
# architectures beyond plain packed attention, on which the engine must be exact too: attention that
# cannot run packed (relative position biases, attention of their own: the padded fallback) and
# sliding windows shorter than the chunks (banded inside each chunk). name -> as ARCHS + model class
FALLBACK_ARCHS = {
    "mpnet": ("MPNetConfig", dict(_SMALL, max_position_embeddings=130, pad_token_id=1), (CLS,), (SEP,), 2, None),
    "deberta-v2": ("DebertaV2Config", dict(_SMALL, max_position_embeddings=128, relative_attention=True,
                                           position_biased_input=False, pos_att_type=["p2c", "c2p"],
                                           max_relative_positions=64, position_buckets=16), (CLS,), (SEP,), 0, None),
    "t5-encoder": ("T5Config", dict(vocab_size=len(VOCAB), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                    relative_attention_num_buckets=8), (), (SEP,), 0, "T5EncoderModel"),
    # local attention of 16 tokens: a token sees those within 8 on its local layers
    "modernbert": ("ModernBertConfig", dict(_SMALL, num_hidden_layers=3, max_position_embeddings=128,
                                            local_attention=16, global_attn_every_n_layers=3, pad_token_id=0,
                                            cls_token_id=CLS, sep_token_id=SEP, bos_token_id=CLS, eos_token_id=SEP), (CLS,), (SEP,), 0, None),
    # causal sliding window of 6 tokens (a token sees itself and the 5 before it) on every layer
    "mistral-swa": ("MistralConfig", dict(_SMALL, max_position_embeddings=256, num_key_value_heads=2, sliding_window=6),
                    (), (SEP,), 0, None),
}
WINDOWED_ARCHS = ("modernbert", "mistral-swa")


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
def tiny(arch: str, **config):
    """(model float32 eval on CPU, tokenizer, prefix ids, suffix ids, first position) for ``arch``
    (a key of `ARCHS` or `FALLBACK_ARCHS`); ``config``: config fields to override (e.g. wider heads)."""
    cls_name, kwargs, prefix, suffix, first, model_cls = (*ARCHS[arch], None) if arch in ARCHS else FALLBACK_ARCHS[arch]
    kwargs = {**kwargs, **config}
    torch.manual_seed(1234)
    model = None
    for implementation in ("sdpa", "eager"):  # MPNet and DeBERTa-v2 have only their own (eager) attention
        config = getattr(transformers, cls_name)(**kwargs)
        config._attn_implementation = implementation
        try:
            model = getattr(transformers, model_cls)(config) if model_cls else transformers.AutoModel.from_config(config)
            break
        except ValueError:
            continue
    model = model.eval().requires_grad_(False)
    # random-init std 0.02 makes every token look alike; widen the weights so chunks differ visibly
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model, make_tokenizer(prefix, suffix), prefix, suffix, first


def _subword_tokenizer(kind: str, prefix: tuple[str, ...], suffix: tuple[str, ...]):
    """A fast tokenizer trained on sentences of `WORDS`: byte-level BPE (GPT-2 / Llama-3 / Qwen style)
    or a SentencePiece-style Unigram with Metaspace (XLM-R / T5 style), with a small vocabulary so
    words split into several tokens; ``prefix``/``suffix`` name its special tokens around a text."""
    from tokenizers import decoders, trainers

    rng = __import__("random").Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(12)) + " passage: query?" for _ in range(300)]
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    if kind == "bpe":
        base = Tokenizer(models.BPE())
        base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        base.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        base = Tokenizer(models.Unigram())
        base.pre_tokenizer = pre_tokenizers.Metaspace()
        base.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=specials, unk_token="<unk>")
    base.train_from_iterator(sentences, trainer)
    single = " ".join([*prefix, "$A", *suffix])
    base.post_processor = TemplateProcessing(
        single=single, special_tokens=[(t, base.token_to_id(t)) for t in sorted(set(prefix) | set(suffix))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=base, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        model_max_length=10**30,
    )


# subword kind -> the special tokens its family puts around a text
_SUBWORD_WRAPPING = {"bpe": (("<s>",), ()), "unigram": (("<s>",), ("</s>",))}


@functools.lru_cache(maxsize=None)
def tiny_subword(arch: str, kind: str):
    """Like `tiny`, with a trained "bpe" or "unigram" tokenizer and a vocabulary to match."""
    pre, suf = _SUBWORD_WRAPPING[kind]
    tok = _subword_tokenizer(kind, pre, suf)
    cls_name, kwargs, _, _, first = ARCHS[arch]
    config = getattr(transformers, cls_name)(**{**kwargs, "vocab_size": len(tok)})
    config._attn_implementation = "sdpa"
    torch.manual_seed(4321)
    model = transformers.AutoModel.from_config(config).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    ids = lambda names: tuple(tok.convert_tokens_to_ids(list(names)))  # noqa: E731
    return model, tok, ids(pre), ids(suf), first
