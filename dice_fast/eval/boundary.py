"""A short-document task where a chunk's context matters: the answer needs two sentences that a chunk
boundary separates.

    task = make_boundary_task(tok, docs=200, seed=0)

Each document is filler ("The grass is green. ..."), then ``"<First Last> has a new pet."`` ending at
about token ``boundary`` (default 256: a chunk boundary for chunk sizes 64 and 128, two tokens past one
for 254), then ``"It is a <animal> called <pet name>."`` and more filler, ``length`` tokens (default 384)
in all. Every person owns two pets of different animals (two documents), and every animal belongs to
many people, so a query ``"What is <First Last>'s <animal> called?"`` is answered by one document only
and only by reading both sentences: the name is in one chunk, the animal and its name in the next. A
chunk encoded alone (DICE) sees half of the question; a late chunk has its neighbour as context.
``answer_span`` is the pet name's characters, so evidence@1 asks whether the chunk found holds it.

Deterministic: output depends only on the seed, the sizes and the tokenizer.
"""

from __future__ import annotations

import numpy as np

from ._haystack import PASSKEY_FILLER, count_tokens
from .tasks import Task

__all__ = ["make_boundary_task"]

FIRST = ("Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kiri", "Luca",
         "Mara", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Soren", "Tala")
LAST = ("Abbott", "Brandt", "Castillo", "Dunmore", "Eriksen", "Fontaine", "Galloway", "Holm", "Ivers", "Jansen",
        "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor")
ANIMALS = ("dog", "cat", "parrot", "horse", "rabbit", "goat", "turtle", "hamster")
PET_NAMES = ("Biscuit", "Pepper", "Maple", "Comet", "Juniper", "Pickle", "Saffron", "Tango", "Waffle", "Zephyr",
             "Nutmeg", "Rocket", "Clover", "Marble", "Pistachio", "Sprocket", "Toffee", "Quartz")


def _filler(tokenizer, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of the passkey filler, cut at a word (one correction pass)."""
    words = (PASSKEY_FILLER + " ") .split() * (n_tokens // 4 + 8)
    n = max(n_tokens, 0)
    text = " ".join(words[:n])
    have = int(count_tokens(tokenizer, [text])[0]) if text else 0
    if have != n_tokens and have:
        n = max(0, round(n * n_tokens / have))
        text = " ".join(words[:n])
    return text


def make_boundary_task(tokenizer, docs: int = 200, seed: int = 0, length: int = 384, boundary: int = 256) -> Task:
    """The boundary task (see the module docstring): ``docs`` documents (even, at most 2 x 300 people),
    one query each; ``length`` / ``boundary`` in tokens of ``tokenizer`` (a fast HF tokenizer)."""
    if docs < 2 or docs % 2 or docs > 2 * len(FIRST) * len(LAST):
        raise ValueError(f"docs must be an even number from 2 to {2 * len(FIRST) * len(LAST)}, got {docs}")
    if not 32 <= boundary < length:
        raise ValueError(f"need 32 <= boundary ({boundary}) < length ({length})")
    rng = np.random.default_rng([int(seed), 3])
    people = rng.choice(len(FIRST) * len(LAST), docs // 2, replace=False)
    corpus, queries, qrels, answer_spans, fact_spans = [], [], [], [], []
    for p in people:
        name = f"{FIRST[p // len(LAST)]} {LAST[p % len(LAST)]}"
        for animal in rng.choice(len(ANIMALS), 2, replace=False):
            pet = PET_NAMES[int(rng.integers(len(PET_NAMES)))]
            first = f"{name} has a new pet."
            second = f"It is a {ANIMALS[animal]} called {pet}."
            pre = _filler(tokenizer, boundary - int(count_tokens(tokenizer, [first])[0]))
            head = f"{pre} {first} " if pre else f"{first} "
            post = _filler(tokenizer, length - boundary - int(count_tokens(tokenizer, [second])[0]))
            at = len(head) + len("It is a ") + len(ANIMALS[animal]) + len(" called ")
            answer_spans.append((at, at + len(pet)))
            fact_spans.append((len(head) - len(first) - 1, len(head) + len(second)))
            qrels.append({len(corpus): 1})
            corpus.append(f"{head}{second} {post}".strip())
            queries.append(f"What is {name}'s {ANIMALS[animal]} called?")
    n = len(corpus)
    return Task(
        name="boundary", queries=queries, corpus=corpus, qrels=qrels,
        query_length=np.full(n, length, np.int64), doc_length=np.full(n, length, np.int64),
        query_ids=[f"boundary-q{i:04d}" for i in range(n)], doc_ids=[f"boundary-{i:04d}" for i in range(n)],
        doc_tokens=count_tokens(tokenizer, corpus).astype(np.int64),
        fact_span=np.array(fact_spans, np.int64).reshape(-1, 2), answer_span=np.array(answer_spans, np.int64).reshape(-1, 2),
    )
