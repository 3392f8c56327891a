"""Opening a store from a URL (what ``dice-fast index push --to`` and `dice_fast.index.open_store` take).

    qdrant://HOST:PORT/COLLECTION          a Qdrant server (HTTP; qdrant+https:// for TLS); the API key,
                                           if any, from api_key= or the QDRANT_API_KEY variable
    qdrant+path://DIR/COLLECTION           Qdrant local mode in the folder DIR (qdrant+path:///abs/dir/c)
    qdrant+memory:///COLLECTION            Qdrant local mode in memory (tests, prototypes)
    lancedb://DIR/TABLE                    a LanceDB database folder DIR (lancedb:///abs/dir/table)

Other keyword options go to the store (dim, encoder, model, encoder_options, store_text, batch_size).
``create=False`` (what ``dice-fast search`` passes) refuses a collection or table that does not exist,
creating nothing (not even the folder of a local Qdrant or a LanceDB database).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OptionError

SCHEMES = ("qdrant://", "qdrant+https://", "qdrant+path://", "qdrant+memory://", "lancedb://")


def split_url(url: str) -> tuple[str, str, str]:
    """(scheme, location, name) of a store URL; ValueError naming the allowed forms otherwise."""
    scheme = next((s for s in SCHEMES if url.startswith(s)), None)
    rest = url[len(scheme):] if scheme else ""
    location, _, name = rest.rpartition("/")
    if scheme is None or not name or (not location and scheme != "qdrant+memory://"):
        raise OptionError(f"store URL {url[:80]!r} is not one of qdrant://HOST:PORT/COLLECTION, "
                         "qdrant+path://DIR/COLLECTION, qdrant+memory:///COLLECTION, lancedb://DIR/TABLE")
    return scheme, location, name


def open_store(url: str, *, api_key: str | None = None, create: bool = True, **options):
    """A `QdrantStore` or `LanceStore` for ``url`` (see the module docstring); ``create=False``: only an
    existing one (`InputError` naming it otherwise)."""
    scheme, location, name = split_url(url)
    local = scheme == "qdrant+path://" or (scheme == "lancedb://" and "://" not in location)
    if not create and local and not Path(location).is_dir():
        from ..errors import InputError

        kind = "Qdrant collection" if scheme == "qdrant+path://" else "LanceDB table"
        raise InputError(f"{kind} {name!r} does not exist (no folder {location})")
    options["create"] = create
    if scheme == "lancedb://":
        from .lance_store import LanceStore

        return LanceStore(location, name, **options)
    from .qdrant_store import QdrantStore
    from ..errors import require

    client_class = require("qdrant_client", extra="qdrant", needed_by="the Qdrant store").QdrantClient
    if scheme == "qdrant+path://":
        client = client_class(path=location)
    elif scheme == "qdrant+memory://":
        client = client_class(":memory:")
    else:
        http = "https" if scheme == "qdrant+https://" else "http"
        client = client_class(url=f"{http}://{location}", api_key=api_key or os.environ.get("QDRANT_API_KEY"))
        from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

        try:  # the first request: a server that is down or refuses the key is the user's to fix
            return QdrantStore(client, name, **options)
        except (ResponseHandlingException, UnexpectedResponse) as exc:
            from ..errors import InputError, one_line

            raise InputError(f"Qdrant at {http}://{location}: {one_line(exc)[:200]}") from None
    return QdrantStore(client, name, **options)
