"""DICE embeddings of a Ray Data dataset: one engine per actor of an actor pool (the model is loaded
once per actor), a text column in, an ``embedding`` column out.

    import ray
    from dice_fast.integrations.ray import encode_dataset
    ds = ray.data.read_parquet("s3://bucket/corpus/")
    ds = encode_dataset(ds, "/models/bge-base", text_column="text", concurrency=8, num_gpus=1,
                        batch_size=512, chunk_size=254, dtype="bfloat16")
    ds.write_parquet("s3://bucket/embeddings/")

or, as a plain callable class for ``map_batches``::

    ds.map_batches(DiceEmbedder, fn_constructor_kwargs={"model": path, "chunk_size": 254},
                   batch_format="pyarrow", batch_size=512, compute=ray.data.ActorPoolStrategy(size=8), num_gpus=1)

Each row's vector is the offline ``DiceEncoder.encode_documents`` vector of its text to float rounding,
whatever the blocks, batches and actors: a document is never split across batches, and what else is
packed into a forward moves a vector only by rounding (on a CPU in float32, up to about 1e-7), so rows
are not bit for bit the offline ones. Added columns (the input columns are kept):

* ``embedding``: ``fixed_size_list<float32>[dim]`` (pyarrow batches) or a (n, dim) float32 array
  (numpy batches);
* with ``return_chunks=True`` also ``chunk_embeddings`` (list of the chunk vectors as aggregated),
  ``chunk_start`` / ``chunk_end`` (list<int64>: each chunk's token span ``[start, end)`` in the
  document, tokenized without special tokens) and ``document_tokens`` (int64).

A row whose text is null or not a string stops the stage with a ValueError naming the row by its
``id_column`` value (default column ``id``). With ``on_invalid="null"`` such rows are kept instead,
with a null embedding (and null chunk columns) and the reason in an ``error`` column (a string
column, null for good rows; present in every batch, so the schema does not change). Numpy batches
cannot hold nulls: there an invalid row's embedding is NaN, its ``document_tokens`` -1, and its
``chunk_embeddings`` / ``chunk_start`` / ``chunk_end`` empty arrays ((0, dim) float32, (0,) int64).

Needs the ``ray`` extra: ``pip install dice-fast[ray]``.
"""

from __future__ import annotations

import os

import numpy as np

from ..scoring import cu_from_chunk_document
from ..errors import require

__all__ = ["DiceEmbedder", "encode_dataset", "DEFAULT_BATCH_SIZE"]

# documents per actor call: each call ends with one partly filled packed batch, so a call should
# hold several token budgets' worth of text (see docs/integrations.md, "On a multi-GPU Ray cluster")
DEFAULT_BATCH_SIZE = 256
CHUNK_COLUMNS = ("chunk_embeddings", "chunk_start", "chunk_end", "document_tokens")
ON_INVALID = ("raise", "null")


class DiceEmbedder:
    """Callable class for ``Dataset.map_batches``: loads one `DiceEncoder` when the actor starts and
    adds the embedding column (and chunk columns, with ``return_chunks``) to every batch.

    model: a local model folder (every node must see it) or None (the bundled all-MiniLM-L6-v2);
    options: `DiceConfig` fields (chunk_size, aggregation, device, dtype, max_batch_tokens ...).
    id_column: the column that names a row in errors (if the batch has it; else its row in the batch).
    on_invalid: "raise" (a ValueError naming the first row whose text is null or not a string) or
    "null" (such rows get a null embedding and the reason in ``error_column``).
    Takes pyarrow, pandas or numpy (dict) batches; returns pyarrow for pyarrow/pandas, a dict for numpy.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, text_column: str = "text",
                 output_column: str = "embedding", return_chunks: bool = False, trust_remote_code: bool = False,
                 id_column: str | None = "id", on_invalid: str = "raise", error_column: str = "error", **options):
        from dice_fast import DiceEncoder

        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a model folder or None (actors load it themselves), got {type(model).__name__}")
        _check_on_invalid(on_invalid)
        self.text_column, self.output_column, self.return_chunks = text_column, output_column, bool(return_chunks)
        self.id_column, self.on_invalid, self.error_column = id_column, on_invalid, error_column
        self.encoder = DiceEncoder.from_pretrained(model, trust_remote_code=trust_remote_code, **options)

    def __call__(self, batch):
        import pyarrow as pa

        if isinstance(batch, dict):
            return self._numpy_batch(batch)
        if not isinstance(batch, pa.Table):  # pandas
            batch = pa.Table.from_pandas(batch, preserve_index=False)
        self._check_columns(batch.column_names)
        ids = batch.column(self.id_column).to_pylist() if self.id_column in batch.column_names else None
        texts, keep, errors = self._valid(batch.column(self.text_column).to_pylist(), ids)
        out = self.encoder.encode_documents(texts, return_chunks=self.return_chunks)
        docs = out.documents if self.return_chunks else out
        # rows in batch order; an invalid row takes a null index, which `take` turns into a null
        rows = None if errors is None else pa.array(_row_index(keep, batch.num_rows), pa.int64())
        batch = batch.append_column(self.output_column, _scatter(_vectors(docs), rows))
        if self.return_chunks:
            for name, array in _chunk_arrays(out).items():
                batch = batch.append_column(name, _scatter(array, rows))
        if self.on_invalid == "null":
            batch = batch.append_column(self.error_column, pa.array(errors or [None] * batch.num_rows, pa.string()))
        return batch

    def _numpy_batch(self, batch: dict) -> dict:
        self._check_columns(list(batch))
        ids = list(batch[self.id_column]) if self.id_column in batch else None
        values = list(batch[self.text_column])
        texts, keep, errors = self._valid(values, ids)
        out = self.encoder.encode_documents(texts, return_chunks=self.return_chunks)
        result = dict(batch)
        docs = out.documents if self.return_chunks else out
        if errors is not None:
            full = np.full((len(values), self.encoder.dim), np.nan, np.float32)
            full[keep] = docs
            docs = full
        result[self.output_column] = docs
        if self.on_invalid == "null":
            result[self.error_column] = np.array(errors or [None] * len(values), dtype=object)
        if not self.return_chunks:
            return result
        bounds = cu_from_chunk_document(out.chunk_document, len(texts))
        slot = _row_index(keep, len(values))
        # an invalid row has no chunks: empty arrays of the column's dtype and width, never None (Ray
        # cannot join a batch's arrays with None into one column)
        for name, values_ in (("chunk_embeddings", np.asarray(out.chunks, np.float32).reshape(-1, self.encoder.dim)),
                              ("chunk_start", np.asarray(out.chunk_start, np.int64)),
                              ("chunk_end", np.asarray(out.chunk_end, np.int64))):
            parts = [values_[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            empty = values_[:0]
            result[name] = _ragged([empty if j is None else parts[j] for j in slot])
        tokens = np.asarray(out.document_tokens, np.int64)
        result["document_tokens"] = np.array([-1 if j is None else tokens[j] for j in slot], np.int64)
        return result

    def _valid(self, values: list, ids: list | None) -> tuple[list[str], list[int], list | None]:
        """(texts of the valid rows, their positions, per-row error or None; the list is None when every
        row is valid). Raises ValueError naming the first invalid row unless ``on_invalid="null"``."""
        errors = None
        texts, keep = [], []
        for i, v in enumerate(values):
            if isinstance(v, str):
                texts.append(v if type(v) is str else str(v))  # numpy batches hold np.str_
                keep.append(i)
                continue
            why = (f"column {self.text_column!r} is null" if v is None else
                   f"column {self.text_column!r} holds {type(v).__name__}, not a string")
            if self.on_invalid == "raise":
                where = (f"row with {self.id_column} {_plain(ids[i])!r}" if ids is not None else
                         f"row {i} of this batch (it has no {self.id_column!r} column to name the row)")
                raise ValueError(f"{where}: {why}; every row needs a string (or pass on_invalid='null' to "
                                 f"keep such rows with a null embedding and an {self.error_column!r} column)")
            if errors is None:
                errors = [None] * len(values)
            errors[i] = why
        return texts, keep, errors

    def _check_columns(self, names) -> None:
        if self.text_column not in names:
            raise KeyError(f"text column {self.text_column!r} is not in the batch (columns: {', '.join(names)})")
        added = (self.output_column, *(CHUNK_COLUMNS if self.return_chunks else ()),
                 *((self.error_column,) if self.on_invalid == "null" else ()))
        clash = [c for c in added if c in names]
        if clash:
            raise ValueError(f"the batch already has column(s) {clash}; choose another output_column or drop them")


def encode_dataset(ds, model: str | os.PathLike | None = None, *, text_column: str = "text",
                   output_column: str = "embedding", return_chunks: bool = False,
                   concurrency: int | tuple[int, int] = 1, batch_size: int = DEFAULT_BATCH_SIZE,
                   num_gpus: float | None = None, num_cpus: float | None = None, trust_remote_code: bool = False,
                   id_column: str | None = "id", on_invalid: str = "raise", error_column: str = "error", **options):
    """``ds`` with an embedding column: ``ds.map_batches(DiceEmbedder, ...)`` over an actor pool.

    concurrency: actors (an int, or ``(min, max)`` for an autoscaling pool); num_gpus / num_cpus: per
    actor (``num_gpus=1``: one GPU each, the engine then runs on CUDA in bfloat16 unless ``device`` /
    ``dtype`` say otherwise); batch_size: documents per actor call (docs/integrations.md says how to size it against
    ``max_batch_tokens``); id_column / on_invalid / error_column: rows whose text is null or not a
    string (see `DiceEmbedder`). Options are checked here, before any actor starts.
    Each actor reserves ``num_cpus`` (Ray's default: 1): leave CPUs free for the read and write tasks,
    or a pipeline whose actors hold every CPU waits forever. Ray Data may reorder rows: keep an id column.
    Returns the lazy `ray.data.Dataset`; rows keep their other columns.
    """
    ray_data = require("ray.data", extra="ray", needed_by="encoding with Ray Data")
    from dice_fast.config import DiceConfig, checked_integer

    DiceConfig.check_names(options)
    DiceConfig(**options)
    _check_on_invalid(on_invalid)
    batch_size = checked_integer("batch_size", batch_size)
    kwargs = dict(model=None if model is None else os.fspath(model), text_column=text_column,
                  output_column=output_column, return_chunks=return_chunks, trust_remote_code=trust_remote_code,
                  id_column=id_column, on_invalid=on_invalid, error_column=error_column, **options)
    extra = {k: v for k, v in (("num_gpus", num_gpus), ("num_cpus", num_cpus)) if v is not None}
    return ds.map_batches(DiceEmbedder, fn_constructor_kwargs=kwargs, batch_format="pyarrow",
                          batch_size=batch_size, compute=_actor_pool(ray_data, concurrency), **extra)


# --------------------------------------------------------------------------------------------------
def _actor_pool(ray_data, concurrency):
    if isinstance(concurrency, tuple) and len(concurrency) == 2 and all(isinstance(v, int) for v in concurrency) \
            and 1 <= concurrency[0] <= concurrency[1]:
        return ray_data.ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1])
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be a positive int or a (min, max) tuple of them, got {concurrency!r}")
    return ray_data.ActorPoolStrategy(size=concurrency)


def _check_on_invalid(on_invalid) -> None:
    if on_invalid not in ON_INVALID:
        raise ValueError(f"on_invalid must be one of {ON_INVALID}, got {on_invalid!r}")


def _plain(value):
    """A numpy scalar as the Python value it holds (so that an id prints as 7, not np.int64(7))."""
    return value.item() if isinstance(value, np.generic) else value


def _row_index(keep: list[int], n: int) -> list:
    """For each of ``n`` rows, its index among the valid rows ``keep`` (None for an invalid row)."""
    slot: list = [None] * n
    for j, i in enumerate(keep):
        slot[i] = j
    return slot


def _scatter(array, rows):
    """``array`` (one entry per valid row) spread over all rows, null where ``rows`` is null."""
    return array if rows is None else array.take(rows)


def _vectors(x: np.ndarray):
    """(n, dim) float32 -> fixed_size_list<float32>[dim] (zero copy)."""
    import pyarrow as pa

    x = np.ascontiguousarray(x, np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])


def _chunk_arrays(out) -> dict:
    import pyarrow as pa

    offsets = pa.array(cu_from_chunk_document(out.chunk_document, len(out.documents)).astype(np.int32))
    return {
        "chunk_embeddings": pa.ListArray.from_arrays(offsets, _vectors(out.chunks)),
        "chunk_start": pa.ListArray.from_arrays(offsets, pa.array(np.asarray(out.chunk_start, np.int64))),
        "chunk_end": pa.ListArray.from_arrays(offsets, pa.array(np.asarray(out.chunk_end, np.int64))),
        "document_tokens": pa.array(np.asarray(out.document_tokens, np.int64)),
    }


def _ragged(parts: list) -> np.ndarray:
    arr = np.empty(len(parts), dtype=object)
    for i, p in enumerate(parts):  # element by element: equal shapes must not be broadcast into one array
        arr[i] = p
    return arr
