"""Opening a store from a URL (what ``dice-fast index push --to`` and `dice_fast.index.open_store` take).

    qdrant://HOST:PORT/COLLECTION          a Qdrant server (HTTP; qdrant+https:// for TLS); the API key,
                                           if any, from api_key= or the QDRANT_API_KEY variable
    qdrant+path://DIR/COLLECTION           Qdrant local mode in the folder DIR (qdrant+path:///abs/dir/c)
    qdrant+memory:///COLLECTION            Qdrant local mode in memory (tests, prototypes)
    lancedb://DIR/TABLE                    a LanceDB database folder DIR (lancedb:///abs/dir/table)

Other keyword options go to the store (dim, encoder, model, encoder_options, store_text, batch_size).
"""

from __future__ import annotations

import os

SCHEMES = ("qdrant://", "qdrant+https://", "qdrant+path://", "qdrant+memory://", "lancedb://")


def split_url(url: str) -> tuple[str, str, str]:
    """(scheme, location, name) of a store URL; ValueError naming the allowed forms otherwise."""
    scheme = next((s for s in SCHEMES if url.startswith(s)), None)
    rest = url[len(scheme):] if scheme else ""
    location, _, name = rest.rpartition("/")
    if scheme is None or not name or (not location and scheme != "qdrant+memory://"):
        raise ValueError(f"store URL {url[:80]!r} is not one of qdrant://HOST:PORT/COLLECTION, "
                         "qdrant+path://DIR/COLLECTION, qdrant+memory:///COLLECTION, lancedb://DIR/TABLE")
    return scheme, location, name


def open_store(url: str, *, api_key: str | None = None, **options):
    """A `QdrantStore` or `LanceStore` for ``url`` (see the module docstring)."""
    scheme, location, name = split_url(url)
    if scheme == "lancedb://":
        from .lance_store import LanceStore

        return LanceStore(location, name, **options)
    from .qdrant_store import QdrantStore
    from .remote import require

    client_class = require("qdrant_client", "qdrant").QdrantClient
    if scheme == "qdrant+path://":
        client = client_class(path=location)
    elif scheme == "qdrant+memory://":
        client = client_class(":memory:")
    else:
        http = "https" if scheme == "qdrant+https://" else "http"
        client = client_class(url=f"{http}://{location}", api_key=api_key or os.environ.get("QDRANT_API_KEY"))
    return QdrantStore(client, name, **options)
