"""Retrieve by document, read by chunk: `DiceIndex` keeps every document's DICE vector and its chunk
vectors with their character spans, and answers a query with documents and the passage that matched.

    from dice_fast import DiceEncoder, DiceIndex
    index = DiceIndex.from_texts(DiceEncoder.from_pretrained(), texts, ids)
    for hit in index.search(["who signed the treaty?"], k=5, scoring="maxsim")[0]:
        print(hit.id, hit.score, hit.text)        # text: the evidence passage

The same vectors go into a Qdrant collection or a LanceDB table with one interface
(`open_store("qdrant://HOST:PORT/COLLECTION" | "qdrant+path://DIR/C" | "lancedb://DIR/TABLE")`: the
same ``upsert_arrays`` / ``add`` / ``search`` and `Hit`s; docs/retrieval.md). A consumer of the core's
public API (`DiceEncoder`, `dice_fast.scoring`); faiss, qdrant-client and lancedb are imported only
when asked for.
"""

from .common import DEFAULT_SCORING, Hit
from .dice_index import DiceIndex

__all__ = ["DiceIndex", "Hit", "DEFAULT_SCORING", "open_store"]


def open_store(url: str, **options):
    """A store from a URL (``qdrant://HOST:PORT/COLLECTION``, ``qdrant+path://DIR/COLLECTION``,
    ``qdrant+memory:///COLLECTION``, ``lancedb://DIR/TABLE``); see `dice_fast.index.stores`."""
    from .stores import open_store as open_url

    return open_url(url, **options)
