"""Shared by the retrieval-stack tests (LangChain, LlamaIndex): the bundled model loaded once, and a
haystack of long documents of real prose, one of them with a planted sentence that a query asks about."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

NEEDLE = "The secret ingredient of Marguerite's lighthouse soup is smoked cardamom from the island of Tarrow."
QUERY = "What is the secret ingredient of Marguerite's lighthouse soup?"


@dataclass(frozen=True)
class Haystack:
    """texts[target] holds ``needle`` near its middle; ids are "doc-0" ...; every text ~600 tokens (3 chunks of 256)."""

    texts: list[str]
    ids: list[str]
    target: int
    needle: str = NEEDLE
    query: str = QUERY


@pytest.fixture(scope="session")
def bundled():
    """The bundled all-MiniLM-L6-v2 on the CPU, float32."""
    from dice_fast import DiceEncoder

    return DiceEncoder.from_pretrained(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def haystack(bundled) -> Haystack:
    from dice_fast.data import prose_documents

    texts = prose_documents(bundled.tokenizer, [600] * 6, seed=18)
    target = 4
    cut = texts[target].find(". ", len(texts[target]) // 2) + 2  # a sentence boundary near the middle
    texts[target] = texts[target][:cut] + NEEDLE + " " + texts[target][cut:]
    return Haystack(texts, [f"doc-{i}" for i in range(len(texts))], target)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A model folder of a tiny random BERT (tests/tiny_models.py) with its word-level tokenizer: quick to
    load in another process. Its texts are words of `tiny_models.WORDS`."""
    import copy

    from tiny_models import tiny

    model, tokenizer, *_ = tiny("bert")
    folder = tmp_path_factory.mktemp("tiny-bert")
    copy.deepcopy(model).save_pretrained(folder)  # saving sets config.architectures: not on the shared model
    tokenizer.save_pretrained(folder)
    return folder
