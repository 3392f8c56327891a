"""Serving (optional extra ``serve``): the async cross-request batching core and the HTTP app over it.

    from dice_fast.serve import AsyncDiceEncoder, create_app
    core = AsyncDiceEncoder(encoder, max_queue_tokens=100_000)   # await core.embed_documents(texts)
    app = create_app(encoder)                                    # FastAPI app: POST /v1/embeddings ...

Importing this package imports neither fastapi, uvicorn, httpx nor torch; `create_app` imports
fastapi when called.
"""

from __future__ import annotations

_LAZY = {
    "AsyncDiceEncoder": "dice_fast.serve.batcher",
    "Embeddings": "dice_fast.serve.batcher",
    "create_app": "dice_fast.serve.app",
}

__all__ = ["AsyncDiceEncoder", "Embeddings", "create_app"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dice_fast.serve' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
