"""From a corpus job to a store: the output of ``dice-fast encode ... --chunks`` written into a
`QdrantStore` or `LanceStore` one Parquet row group (4,096 documents as encode writes them) at a time,
after a first pass over the ids that keeps 8 bytes each: never the whole corpus in memory.

Every write replaces documents by id, so a push can be repeated. A push into a store that already
holds documents must say ``resume=True``: then every row group the store already holds as it is (every
id, with the same vectors and spans: `RemoteStore.holds`) is skipped, and the others are written again
whole (one cut off by a crash, or re-encoded after an edit), so a push killed anywhere and
resumed leaves every document exactly once, and a push of a re-encoded corpus updates what changed.
Documents the store holds that the output lacks are kept (delete them with ``store.delete``).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


def push(output, store, *, resume: bool = False, progress: bool = True, files: list | None = None) -> dict:
    """Write the encode output ``output`` (a .parquet file or a shard folder) into ``store``; ``files``:
    its checked files (`corpus_output.corpus_files`) where the caller has them already.

    Returns {"documents": written, "skipped": documents ``resume`` found stored as they are,
    "shards": n}.
    ValueError when the store holds documents and ``resume`` is False, when its recorded model
    and options differ from the job's (checked when the store was opened with them), or when two rows
    of the output hold one id (named with both files and rows), before anything is written.
    """
    from tqdm.auto import tqdm

    from .common import check_output_ids
    from .corpus_output import corpus_files, read_corpus_parts, read_ids

    files = corpus_files(output) if files is None else files
    if len(store) and not resume:
        raise InputError(f"{store.where} already holds {len(store)} documents: pass --resume (resume=True) to "
                         "continue a push into it, or choose another collection")
    total = check_output_ids(files, read_ids)  # a repeated id would be written twice, the second replacing the first
    bar = tqdm(total=total, unit="doc", desc=f"push to {store.where}", disable=not progress, dynamic_ncols=True)
    written = skipped = 0
    try:
        for file in files:
            for data in read_corpus_parts(Path(file)):  # a row group at a time (4,096 rows as encode writes them)
                ids = data[0]
                if resume and all(store.contains(ids)) and store.holds(*data):  # stored as they are now
                    skipped += len(ids)
                else:
                    store.upsert_arrays(*data)
                    written += len(ids)
                bar.update(len(ids))
    finally:
        bar.close()
    return {"documents": written, "skipped": skipped, "shards": len(files)}


def store_for_output(url: str, output, batch_size: int | None = None):
    """Open the store at ``url`` for the vectors of ``output``: the job's width, model and options
    (a store holding another model's vectors is refused), no texts (an encode output holds none).
    An output without the chunk columns (encoded without ``--chunks``) is refused naming its file
    before the store is opened (which would create it)."""
    import pyarrow.parquet as pq

    from ..errors import reading_parquet
    from .corpus_output import check_chunk_columns, corpus_encoder, corpus_files
    from .stores import open_store

    for file in corpus_files(output, check=False):  # schemas only: push checks each shard once
        with reading_parquet(file):
            names = pq.read_schema(file).names
        check_chunk_columns(file, names, "push")
    model, options, dim = corpus_encoder(output)
    extra = {} if batch_size is None else {"batch_size": batch_size}
    return open_store(url, dim=dim, model=model, encoder_options=options, store_text=False, **extra)
