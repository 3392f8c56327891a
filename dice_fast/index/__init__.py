"""Retrieve by document, read by chunk: `DiceIndex` keeps every document's DICE vector and its chunk
vectors with their character spans, and answers a query with documents and the passage that matched.

    from dice_fast import DiceEncoder, DiceIndex
    index = DiceIndex.from_texts(DiceEncoder.from_pretrained(), texts, ids)
    for hit in index.search(["who signed the treaty?"], k=5, scoring="maxsim")[0]:
        print(hit.id, hit.score, hit.text)        # text: the evidence passage

A consumer of the core's public API (`DiceEncoder`, `dice_fast.scoring`); faiss is imported only
when an approximate search asks for it.
"""

from .common import DEFAULT_SCORING, Hit
from .dice_index import DiceIndex

__all__ = ["DiceIndex", "Hit", "DEFAULT_SCORING", "open_store"]


def open_store(url: str, **options):
    """A store from a URL (``qdrant://HOST:PORT/COLLECTION``, ``qdrant+path://DIR/COLLECTION``,
    ``qdrant+memory:///COLLECTION``, ``lancedb://DIR/TABLE``); see `dice_fast.index.stores`."""
    from .stores import open_store as open_url

    return open_url(url, **options)
