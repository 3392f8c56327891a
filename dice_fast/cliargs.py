"""The model and DICE options every command shares: one argument group, one way to build the encoder."""

from __future__ import annotations

import argparse

import dataclasses
import typing

from .config import DiceConfig
from .errors import ArgumentTypeError, OptionError


def _value_type(field: dataclasses.Field, config_cls: type):
    """The field's type without ``None``: ``int | None`` -> int."""
    hint = typing.get_type_hints(config_cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if len(args) != 1 or args[0] not in (int, float, str, bool):
        raise ArgumentTypeError(f"DiceConfig.{field.name}: no flag for type {hint!r} (give int, float, str or bool)")
    return args[0]


def _flag_help(field: dataclasses.Field) -> str:
    """The option's help and what its default is; an on/off flag (``--no-name`` for a default of
    True: "do not <help>") needs no default."""
    meta = field.metadata
    if not meta.get("help"):
        raise ArgumentTypeError(f"DiceConfig.{field.name} has no help: declare it with config.option(default, help)")
    if isinstance(field.default, bool):
        text = f"do not {meta['help']}" if field.default else meta["help"]
    else:
        default = meta["default_help"]
        if default is None and field.default is None:
            raise ArgumentTypeError(f"DiceConfig.{field.name} defaults to None: say what that means (default_help=...)")
        text = f"{meta['help']} (default: {field.default if default is None else default})"
    return text.replace("%", "%%")


def encoder_flag(field: dataclasses.Field, config_cls: type = DiceConfig) -> tuple[str, dict]:
    """The flag of one field of `DiceConfig` (or of ``config_cls``, a subclass) and its `add_argument`
    keywords (``dest`` is the field's name); TypeError naming the field when it has no help."""
    meta, kind = field.metadata, _value_type(field, config_cls)
    dashed = field.name.replace("_", "-")
    spec = {"dest": field.name, "default": field.default, "help": _flag_help(field)}
    if kind is bool:
        if field.default is None:
            return f"--{dashed}", {**spec, "action": argparse.BooleanOptionalAction}
        if field.default:
            return f"--no-{dashed}", {**spec, "action": "store_false"}
        return f"--{dashed}", {**spec, "action": "store_true"}
    spec["type"] = kind
    if meta.get("choices") is not None:
        spec["choices"] = meta["choices"]
    if meta.get("metavar"):
        spec["metavar"] = meta["metavar"]
    return f"--{dashed}", spec


def encoder_options(args, config_cls: type = DiceConfig) -> dict:
    """The `DiceConfig` options parsed by the flags of `add_encoder_arguments`: one entry per field."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)}


def encoder_flags_given(args, config_cls: type = DiceConfig) -> list[str]:
    """The flags of `add_encoder_arguments` that ``args`` holds a value other than the default for
    (``--model``: any folder), for a command path that encodes nothing and must not ignore them."""
    given = ["--model"] if getattr(args, "model", None) is not None else []
    return given + [encoder_flag(f, config_cls)[0] for f in dataclasses.fields(config_cls)
                    if getattr(args, f.name) != f.default]


def add_encoder_arguments(p: argparse.ArgumentParser, config_cls: type = DiceConfig) -> None:
    """``--model`` and one flag per `DiceConfig` field (`encoder_flag`), shared by every sub-command
    that builds an encoder."""
    g = p.add_argument_group("model and DICE options")
    g.add_argument("--model", default=None, help="model folder (default: the bundled all-MiniLM-L6-v2)")
    for field in dataclasses.fields(config_cls):
        flag, spec = encoder_flag(field, config_cls)
        g.add_argument(flag, **spec).empty_text = field.metadata.get("empty_text", False)


def bounded(kind: type, low: float, *, above: bool = False):
    """An argparse ``type``: a ``kind`` (int or float) of at least ``low`` (greater, when ``above``);
    nan, inf and what is not a number are refused, naming the value (argparse adds the flag)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if value != value or abs(value) == float("inf") or (value <= low if above else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {low:g}, got {text!r}")
        return value

    return parse


def add_cache_arguments(p: argparse.ArgumentParser, default_max_gb: float | None = None):
    """``--cache DIR`` and ``--cache-max-gb N`` (``default_max_gb``: the bound when ``--cache`` comes alone;
    None: unbounded); returns their argument group (for a command's own cache flags)."""
    g = p.add_argument_group("chunk cache (a chunk's vector depends only on its tokens, the model and options)")
    g.add_argument("--cache", metavar="DIR", default=None,
                   help="persistent chunk cache folder (created if missing, 0700, its files 0600: they hold the "
                   "encoded text's token ids; shareable by processes): chunks found there are not encoded "
                   "again, new ones are added")
    default = "unbounded" if default_max_gb is None else f"{default_max_gb:g}"
    g.add_argument("--cache-max-gb", type=_max_gb, default=None, metavar="N",
                   help="bound the cache to N GB ('unbounded': no bound); least recently used chunks are evicted "
                   f"(default: {default})")
    p.set_defaults(cache_default_max_gb=default_max_gb)
    return g


def _max_gb(text: str) -> float:
    """``--cache-max-gb``'s value: a number of GB > 0, or inf for 'unbounded'."""
    if text.strip().lower() == "unbounded":
        return float("inf")
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0 or 'unbounded', got {text!r}")
    return value


def make_encoder(args):
    """A `DiceEncoder` for ``--model`` with the options of `add_encoder_arguments` (and of
    `add_cache_arguments` where the command has them)."""
    from .engine import DiceEncoder

    return DiceEncoder.from_pretrained(args.model, **cache_options(args), **encoder_options(args))


def cache_options(args) -> dict:
    """``cache`` and ``cache_max_gb`` for `DiceEncoder` from `add_cache_arguments`' flags ({} without ``--cache``;
    the command's default bound when ``--cache-max-gb`` is not given)."""
    explicit = getattr(args, "cache_max_gb", None)
    if not getattr(args, "cache", None):
        if explicit is not None:
            raise OptionError("--cache-max-gb needs --cache DIR")
        return {}
    max_gb = explicit if explicit is not None else getattr(args, "cache_default_max_gb", None)
    return {"cache": args.cache, "cache_max_gb": None if max_gb == float("inf") else max_gb}
