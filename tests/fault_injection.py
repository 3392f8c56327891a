"""Faults injected where they really arise: a forward pre-hook on the model that raises (by default
``torch.OutOfMemoryError``) for the batches a predicate picks, e.g. those over a size or those holding
the `POISON` token (a chunk holding it fails whatever batch it is in)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from tiny_models import VOCAB, WORDS

POISON = "?"  # in the tiny models' vocabulary, never among the `WORDS` test texts are made of
assert POISON in VOCAB and POISON not in WORDS


def out_of_memory() -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def has_poison(ids) -> bool:
    """Whether the token ids ``ids`` (a tensor or array) hold the `POISON` token."""
    return bool((np.asarray(ids) == VOCAB[POISON]).any())


def poisoned(text: str) -> str:
    """``text`` with the `POISON` token after its third word."""
    words = text.split()
    return " ".join(words[:3] + [POISON] + words[3:])


@contextlib.contextmanager
def failing_forward(model, predicate, error=out_of_memory):
    """While inside, every forward of ``model`` whose input_ids satisfy ``predicate`` raises ``error()``.
    Yields the list of (tokens, raised) of every forward."""
    seen = []

    def hook(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        raised = bool(predicate(ids))
        seen.append((ids.numel(), raised))
        if raised:
            raise error()

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()
