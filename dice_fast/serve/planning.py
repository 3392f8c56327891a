"""A request's texts to an `EncodingPlan`, refused as early as a limit shows it is too big: the
character limit before any tokenizing, then tokenization in bounded pieces
(`dice_fast.pieces.tokenize_bounded`) that stops as soon as the tokens found pass a token limit, and
over-long queries refused or cut (``auto_truncate``). Used by `AsyncDiceEncoder`; no HTTP here."""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from ..chunking import EncodingPlan, TokenizedDocuments
from ..errors import OptionError, TextError
from ..pieces import PIECE_CHARS
from .errors import InvalidRequest, RequestTooLarge


class Abandoned(Exception):
    """The request's awaiting task was cancelled while its texts were being tokenized."""


def piece_chars(encoder) -> int | None:
    """Characters per tokenizer call for ``encoder``: `PIECE_CHARS` where cutting texts at word gaps gives
    the ids of the whole (`cuts_are_exact`, checked once here), else None (whole texts)."""
    return PIECE_CHARS if encoder.cuts_are_exact() else None


def input_name(field: str, index: int, scalar: bool = False) -> str:
    """How errors name text ``index`` of ``field``: ``field[index]``, or ``field`` alone when ``scalar``
    (a field that holds one string, such as ``/v1/evidence``'s ``query``)."""
    return field if scalar else f"{field}[{index}]"


def check_chars(texts: list[str], limit: int, field: str = "input", scalar: bool = False) -> None:
    """`RequestTooLarge` naming the first text (`input_name`) of more than ``limit`` characters."""
    for i, text in enumerate(texts):
        if len(text) > limit:
            name = input_name(field, i, scalar)
            raise RequestTooLarge(f"{name} has {len(text)} characters; the limit is {limit} per input "
                                  "(max_input_chars)", param=name)


def plan_request(encoder, texts: list[str], kind: str, *, piece_chars: int | None, auto_truncate: bool,
                 check_sizes: Callable[..., None], abandoned: threading.Event,
                 field: str = "input", scalar: bool = False,
                 strategy: str | None = None) -> tuple[EncodingPlan, tuple[int, ...]]:
    """(plan, indices of queries cut to the window) of ``texts`` as ``kind`` ("documents" / "queries").

    Between tokenizer calls, ``check_sizes(tokens, at_least=True)`` gets (n,) lower bounds of the tokens
    per text the model will run and refuses by raising; a query over the window raises
    `RequestTooLarge` naming it unless ``auto_truncate``; ``abandoned`` set stops the work (`Abandoned`).
    A text that is not valid Unicode raises `InvalidRequest`, a ``positions="global"`` document needing
    more positions than the model has `RequestTooLarge`, each naming its text (`input_name` of ``field``,
    ``scalar``); a ``strategy`` (documents:
    one of `STRATEGIES`, None the encoder's) the encoder's options cannot take `InvalidRequest` naming
    "strategy", before any tokenizing. Runs in any thread.
    """
    try:
        used = encoder.max_tokens_used(kind, strategy)  # None, or what a longer text is cut to
    except OptionError as exc:  # e.g. late chunking on an encoder pooling by CLS
        raise InvalidRequest(str(exc), param="strategy") from None
    refuse_long = kind == "queries" and not auto_truncate

    def name(i: int) -> str:
        return input_name(field, i, scalar)

    def refuse_long_queries(counts: np.ndarray) -> None:
        if refuse_long and (over := np.flatnonzero(counts > used)).size:
            i = int(over[0])
            raise RequestTooLarge(f"{name(i)} has more than {used} tokens, more than the model window "
                                  f"({encoder.window} tokens with special tokens) holds for a query; shorten it, "
                                  "or let the server cut it (auto_truncate, dice-fast serve --auto-truncate)",
                                  param=name(i))

    def check(counts: np.ndarray) -> None:
        if abandoned.is_set():
            raise Abandoned
        refuse_long_queries(counts)
        check_sizes(counts if used is None else np.minimum(counts, used), at_least=True)

    try:
        tokens = encoder.tokenize_bounded(texts, piece_chars=piece_chars, check=check,
                                          enough=used if kind == "queries" else None, what=field, kind=kind)
    except TextError as exc:  # not valid Unicode
        raise InvalidRequest(_renamed(str(exc), f"{field}[{exc.index}]", name(exc.index)),
                             param=name(exc.index)) from None
    refuse_long_queries(tokens.lengths)
    truncated = ()
    if kind == "queries" and (over := np.flatnonzero(tokens.lengths > used)).size:
        truncated = tuple(int(i) for i in over)
        tokens = keep_first(tokens, used)
    try:
        return encoder.plan_tokens(tokens, kind, strategy), truncated
    except TextError as exc:  # positions="global": more positions than the model has
        raise RequestTooLarge(f"{name(exc.index)}: {exc}", param=name(exc.index)) from None


def _renamed(message: str, core_name: str, name: str) -> str:
    """``message`` of the core, which names the text ``core_name``, naming it ``name`` instead."""
    return name + message[len(core_name):] if message.startswith(core_name) else message


def keep_first(tokens: TokenizedDocuments, n: int) -> TokenizedDocuments:
    """``tokens`` with every text cut to its first ``n`` ids."""
    lengths = np.minimum(tokens.lengths, n)
    keep = [np.arange(a, a + k) for a, k in zip(tokens.offsets[:-1], lengths)]
    offsets = np.zeros_like(tokens.offsets)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedDocuments(tokens.ids[np.concatenate(keep) if keep else np.zeros(0, np.int64)], offsets)
