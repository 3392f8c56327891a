"""Ray Data: Parquet in, two actors, Parquet out; every row's vector (and chunks) equal to the offline
`encode_documents` of its text, whatever the blocks, batches and actors."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pc = pytest.importorskip("pyarrow.compute")

# Ray starts its cluster and actor pools in the first test that needs them: more than the default 120 s
# on a loaded 2-core machine
pytestmark = pytest.mark.timeout(480)

from dice_fast import DiceEncoder  # noqa: E402
from dice_fast.integrations.ray import DiceEmbedder, encode_dataset  # noqa: E402

CHUNK = 32
OPTIONS = dict(chunk_size=CHUNK, max_batch_tokens=512)  # many chunks, several packed batches per call
WORDS = ("river stone lantern quiet engine maple harbor violet signal orchard copper meadow thunder cedar "
         "galaxy pencil whisper canyon").split()


def _corpus(n: int = 36) -> list[str]:
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 260, n)
    lengths[:3] = (0, 1, 500)  # empty, one word, many chunks
    return [" ".join(rng.choice(WORDS, int(k))) for k in lengths]


def _matrix(column) -> np.ndarray:
    """fixed_size_list<float32>[dim] column -> (n, dim)."""
    col = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    return col.flatten().to_numpy().reshape(len(col), -1)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    ctx = ray.data.DataContext.get_current()
    saved = ctx.wait_for_min_actors_s, ctx.enable_progress_bars
    ctx.wait_for_min_actors_s, ctx.enable_progress_bars = 240, False  # both actors up before the first batch (slow on a loaded 2-core machine)
    try:
        yield
    finally:
        ctx.wait_for_min_actors_s, ctx.enable_progress_bars = saved
        ray.shutdown()


@pytest.fixture(scope="module")
def offline():
    texts = _corpus()
    enc = DiceEncoder.from_pretrained(None, **OPTIONS)
    return texts, enc.encode_documents(texts, return_chunks=True)


@pytest.fixture(scope="module")
def parquet_in(tmp_path_factory):
    texts = _corpus()
    root = tmp_path_factory.mktemp("corpus")
    ids = np.arange(len(texts))
    for part in range(3):  # three files: several blocks
        sel = ids[part::3]
        pq.write_table(pa.table({"id": pa.array(sel, pa.int64()), "text": [texts[i] for i in sel]}),
                       root / f"part-{part}.parquet")
    return root


class PidEmbedder(DiceEmbedder):
    """Records which actor encoded each row."""

    def __call__(self, batch):
        out = super().__call__(batch)
        return out.append_column("pid", pa.array(np.full(out.num_rows, os.getpid(), np.int64)))


def test_parquet_to_parquet_on_two_actors_equals_offline(cluster, offline, parquet_in, tmp_path):
    texts, want = offline
    ds = ray.data.read_parquet(str(parquet_in)).repartition(4)
    out_dir = tmp_path / "out"
    # half a CPU per actor: two actors holding both CPUs of this 2-CPU cluster would starve the read and
    # write tasks, and the pipeline would wait forever
    encode_dataset(ds, None, return_chunks=True, concurrency=2, batch_size=5, num_cpus=0.5, **OPTIONS) \
        .write_parquet(str(out_dir))

    table = pq.read_table(out_dir).sort_by("id")
    assert table.column("id").to_pylist() == list(range(len(texts)))
    assert table.column("text").to_pylist() == texts               # input columns kept
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    np.testing.assert_allclose(_matrix(table.column("embedding")), want.documents, atol=1e-6)

    bounds = np.concatenate([[0], np.cumsum(np.bincount(want.chunk_document, minlength=len(texts)))])
    chunks = table.column("chunk_embeddings").to_pylist()
    starts, ends = table.column("chunk_start").to_pylist(), table.column("chunk_end").to_pylist()
    for i in range(len(texts)):
        a, b = bounds[i], bounds[i + 1]
        np.testing.assert_allclose(np.asarray(chunks[i], np.float32).reshape(b - a, 384), want.chunks[a:b], atol=1e-6)
        assert starts[i] == want.chunk_start[a:b].tolist() and ends[i] == want.chunk_end[a:b].tolist()
    assert table.column("document_tokens").to_pylist() == want.document_tokens.tolist()
    assert max(len(c) for c in chunks) > 10                          # the long document really is chunked


def test_map_batches_callable_class_uses_both_actors(cluster, offline, parquet_in):
    texts, want = offline
    # the subclass lives in this test module, which the actors cannot import: ship it by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ds = ray.data.read_parquet(str(parquet_in)).repartition(6).map_batches(  # 6 blocks: work for both actors
        PidEmbedder, fn_constructor_kwargs=OPTIONS, batch_format="pyarrow", batch_size=3,
        compute=ray.data.ActorPoolStrategy(size=2), num_cpus=0.5)
    table = pa.concat_tables(list(ds.iter_batches(batch_format="pyarrow", batch_size=None))).sort_by("id")
    np.testing.assert_allclose(_matrix(table.column("embedding")), want.documents, atol=1e-6)
    assert len(set(table.column("pid").to_pylist())) == 2


def test_embedder_batch_formats_and_errors(offline):
    """The callable class itself, without Ray: pyarrow, pandas and numpy batches."""
    import pandas as pd

    texts, want = offline
    emb = DiceEmbedder(None, **OPTIONS)
    got = emb(pa.table({"text": texts[:6], "k": list(range(6))}))
    assert got.column_names == ["text", "k", "embedding"]
    np.testing.assert_allclose(_matrix(got.column("embedding")), want.documents[:6], atol=1e-6)
    got = emb(pd.DataFrame({"text": texts[:4]}))
    np.testing.assert_allclose(_matrix(got.column("embedding")), want.documents[:4], atol=1e-6)
    got = emb({"text": np.array(texts[:4]), "k": np.arange(4)})               # a '<U' array of np.str_
    assert got["embedding"].shape == (4, 384) and list(got["k"]) == [0, 1, 2, 3]
    np.testing.assert_allclose(got["embedding"], want.documents[:4], atol=1e-6)

    emb_chunks = DiceEmbedder(None, return_chunks=True, **OPTIONS)
    got = emb_chunks({"text": np.array(texts[:3], dtype=object)})
    n0 = int((want.chunk_document == 0).sum())
    np.testing.assert_allclose(got["chunk_embeddings"][0], want.chunks[:n0], atol=1e-6)
    assert list(got["document_tokens"]) == want.document_tokens[:3].tolist()

    with pytest.raises(KeyError, match="text column 'body'"):
        DiceEmbedder.__call__(_with(emb, text_column="body"), pa.table({"text": ["x"]}))
    with pytest.raises(ValueError, match="already has"):
        emb(pa.table({"text": ["x"], "embedding": [1.0]}))
    with pytest.raises(ValueError, match="row 1 of this batch .it has no 'id' column to name the row.: column "
                                         "'text' is null; every row needs a string .or pass on_invalid='null'"):
        emb(pa.table({"text": ["x", None]}))
    with pytest.raises(ValueError, match="row with id 'b': column 'text' is null"):
        emb(pa.table({"id": ["a", "b"], "text": ["x", None]}))
    with pytest.raises(ValueError, match="row with id 7: column 'text' holds int, not a string"):
        emb({"id": np.array([6, 7]), "text": np.array(["x", 3], dtype=object)})
    with pytest.raises(ValueError, match="on_invalid must be one of"):
        DiceEmbedder(None, on_invalid="skip")


def test_invalid_rows_kept_with_a_null_embedding_and_the_reason(offline):
    """on_invalid="null": bad rows get a null embedding (NaN in numpy batches) and an error; the other
    rows are exactly the offline vectors, chunk columns included."""
    texts, want = offline
    emb = DiceEmbedder(None, on_invalid="null", return_chunks=True, **OPTIONS)
    got = emb(pa.table({"id": [0, 1, 2, 3], "text": [texts[0], None, texts[2], None]}))
    assert got.column("error").to_pylist() == [None, "column 'text' is null", None, "column 'text' is null"]
    assert got.column("embedding").null_count == 2 and got.column("chunk_embeddings").null_count == 2
    good = got.filter(pa.array([True, False, True, False]))
    np.testing.assert_allclose(_matrix(good.column("embedding")), want.documents[[0, 2]], atol=1e-6)
    assert good.column("document_tokens").to_pylist() == want.document_tokens[[0, 2]].tolist()
    n0 = int((want.chunk_document == 0).sum())
    np.testing.assert_allclose(np.asarray(good.column("chunk_embeddings").to_pylist()[0], np.float32).reshape(n0, -1),
                               want.chunks[:n0], atol=1e-6)
    only_bad = emb(pa.table({"text": pa.array([None], pa.string())}))  # nothing valid to encode
    assert only_bad.column("embedding").to_pylist() == [None]
    assert emb(pa.table({"text": texts[:2]})).column("error").null_count == 2  # the column is always there

    got = DiceEmbedder(None, on_invalid="null", **OPTIONS)({"text": np.array([texts[1], 5], dtype=object)})
    assert np.isnan(got["embedding"][1]).all() and list(got["error"]) == [None, "column 'text' holds int, not a string"]
    np.testing.assert_allclose(got["embedding"][:1], want.documents[1:2], atol=1e-6)


def test_numpy_batches_keep_invalid_rows_with_empty_chunk_arrays(offline):
    """Numpy batches cannot hold nulls: an invalid row's chunk columns are empty arrays of the column's
    dtype and width (as its embedding is NaN and its document_tokens -1), never None."""
    texts, want = offline
    emb = DiceEmbedder(None, on_invalid="null", return_chunks=True, **OPTIONS)
    got = emb({"id": np.arange(3), "text": np.array([texts[2], None, texts[3]], dtype=object)})
    assert got["chunk_embeddings"][1].shape == (0, 384) and got["chunk_embeddings"][1].dtype == np.float32
    for name in ("chunk_start", "chunk_end"):
        assert got[name][1].shape == (0,) and got[name][1].dtype == np.int64 and got[name][0].dtype == np.int64
    assert np.isnan(got["embedding"][1]).all() and list(got["document_tokens"]) == [
        want.document_tokens[2], -1, want.document_tokens[3]]
    a = int((want.chunk_document < 2).sum())
    n2 = int((want.chunk_document == 2).sum())
    np.testing.assert_allclose(got["chunk_embeddings"][0], want.chunks[a:a + n2], atol=1e-6)


def test_numpy_batches_with_a_null_text_through_ray(cluster, offline):
    """The same through Ray: batches with and without invalid rows join into one dataset."""
    texts, want = offline
    rows = [{"id": i, "text": None if i in (2, 7) else texts[i]} for i in range(9)]
    ds = ray.data.from_items(rows).repartition(3).map_batches(
        DiceEmbedder, fn_constructor_kwargs=dict(on_invalid="null", return_chunks=True, **OPTIONS),
        batch_format="numpy", batch_size=3, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.5)
    got = sorted(ds.take_all(), key=lambda r: r["id"])
    assert [r["error"] for r in got] == [None, None, "column 'text' is null"] + [None] * 4 + [
        "column 'text' is null", None]
    bounds = np.concatenate([[0], np.cumsum(np.bincount(want.chunk_document, minlength=len(texts)))])
    for r in got:
        i = r["id"]
        if r["error"] is None:
            np.testing.assert_allclose(r["embedding"], want.documents[i], atol=1e-6)
            assert list(r["chunk_start"]) == want.chunk_start[bounds[i]:bounds[i + 1]].tolist()
        else:
            assert np.isnan(r["embedding"]).all() and r["document_tokens"] == -1
            assert len(r["chunk_start"]) == len(r["chunk_end"]) == len(r["chunk_embeddings"]) == 0


def test_a_null_text_names_its_row_or_is_kept_with_an_error(cluster, offline):
    """Through Ray: the default stops the job naming the row by its id; on_invalid="null" keeps it."""
    texts, want = offline
    table = pa.table({"id": [f"r{i}" for i in range(6)], "text": [texts[0], texts[1], None, texts[3], None, texts[5]]})
    ds = ray.data.from_arrow(table)
    kept = encode_dataset(ds, None, on_invalid="null", num_cpus=0.5, batch_size=3, **OPTIONS).to_arrow_refs()
    got = pa.concat_tables(ray.get(kept)).sort_by("id")
    assert got.column("error").to_pylist() == [None, None, "column 'text' is null", None, "column 'text' is null", None]
    good = got.filter(pc.is_valid(got.column("embedding")))
    np.testing.assert_allclose(_matrix(good.column("embedding")), want.documents[[0, 1, 3, 5]], atol=1e-6)
    with pytest.raises(Exception) as failure:
        encode_dataset(ds, None, num_cpus=0.5, batch_size=3, **OPTIONS).materialize()
    assert "row with id 'r2': column 'text' is null" in _chain(failure.value)


def _chain(exc: BaseException) -> str:
    """Every message in an exception's chain (Ray wraps the actor's error)."""
    parts = []
    while exc is not None and len(parts) < 10:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def test_encode_dataset_checks_options_before_starting_actors(cluster):
    ds = ray.data.from_items([{"text": "x"}])  # lazily built; nothing runs
    with pytest.raises(TypeError, match="unknown option"):
        encode_dataset(ds, None, chunk_sise=3)
    with pytest.raises(ValueError, match="overlap"):
        encode_dataset(ds, None, chunk_size=8, overlap=8)
    with pytest.raises(ValueError, match="concurrency"):
        encode_dataset(ds, None, concurrency=0)
    with pytest.raises(ValueError, match="batch_size"):
        encode_dataset(ds, None, batch_size=0)
    with pytest.raises(ValueError, match="on_invalid"):
        encode_dataset(ds, None, on_invalid="drop")


def _with(emb, **attrs):
    clone = object.__new__(type(emb))
    clone.__dict__.update(emb.__dict__, **attrs)
    return clone
