"""dice_fast: exact, packed DICE encoding of long documents.

    from dice_fast import DiceEncoder
    enc = DiceEncoder.from_pretrained()            # the bundled all-MiniLM-L6-v2
    docs = enc.encode_documents(texts)             # (n_docs, dim) float32, row i is texts[i]
    qs = enc.encode_queries(queries)               # (n_queries, dim) float32

Every error the core raises derives from `DiceError` (`dice_fast.errors`).

Importing this package is cheap: it touches no GPU, compiles nothing and imports neither
transformers, triton nor flash-attn; those load on first use.
"""

from __future__ import annotations

__version__ = "0.2.0"

_LAZY = {
    "DiceEncoder": "dice_fast.engine",
    "DiceOutput": "dice_fast.output",
    "DiceConfig": "dice_fast.config",
    "EncodingPlan": "dice_fast.chunking",
    "DiceIndex": "dice_fast.index",
    "ChunkCache": "dice_fast.reuse.persistent",
    "Settings": "dice_fast.settings",
    **{name: "dice_fast.errors" for name in ("DiceError", "OptionError", "ArgumentTypeError", "TextError", "InputError",
                                              "MissingDependency", "ModelError", "CacheError", "InputOutOfMemory", "NonFiniteOutput",
                                              "Int8Unsupported", "MissingFile", "WriteError")},
}

__all__ = ["DiceEncoder", "DiceOutput", "DiceConfig", "EncodingPlan", "DiceIndex", "ChunkCache", "Settings",
           "DiceError", "OptionError", "ArgumentTypeError", "TextError", "ModelError", "CacheError",
           "InputOutOfMemory", "NonFiniteOutput", "InputError", "Int8Unsupported", "MissingDependency", "MissingFile", "WriteError",
           "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dice_fast' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
