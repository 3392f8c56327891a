"""Corpus jobs: streaming documents from files into vectors (the ``dice-fast encode`` command).

``load_embeddings(path) -> (ids, vectors)`` reads any output of the command back (a ``.npy`` with its
ids file, a ``.parquet``, or a shard folder, splits interleaved back into input order).
"""


def __getattr__(name: str):
    if name == "load_embeddings":
        from .loading import load_embeddings

        return load_embeddings
    raise AttributeError(f"module 'dice_fast.corpus' has no attribute {name!r}")


__all__ = ["load_embeddings"]
