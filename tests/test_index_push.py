"""``dice-fast index push OUT --to URL``: a corpus job's output (encode --chunks, a tiny model, several
shards) written into Qdrant (local path) and LanceDB equals `DiceIndex.from_corpus`; a push killed
midway (SIGKILL) and resumed holds every document once; a non-empty store needs --resume."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dice_fast import DiceIndex
from dice_fast.cli import main
from dice_fast.index import open_store
from test_index_folder import model_folder  # noqa: F401 (a fixture)

pytest.importorskip("qdrant_client")
pytest.importorskip("lancedb")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
N_DOCS, SHARD_ROWS, BATCH = 240, 40, 16


@pytest.fixture
def corpus_output(tmp_path, model_folder):  # noqa: F811
    rng = np.random.default_rng(0)
    words = ["river", "stone", "cloud", "field", "light", "house", "tree", "song", "blue", "red", "old"]
    src = tmp_path / "in.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for i in range(N_DOCS):
            text = " ".join(rng.choice(words, int(rng.integers(3, 40))))
            f.write(json.dumps({"id": f"d{i:03d}", "text": text}) + "\n")
    out = tmp_path / "out"
    assert main(["encode", str(src), "-o", f"{out}/", "--chunks", "--chunk-size", "8", "--model", str(model_folder),
                 "--device", "cpu", "--shard-rows", str(SHARD_ROWS), "--id-field", "id", "--quiet"]) == 0
    return out


def _urls(tmp_path):
    return [f"qdrant+path://{tmp_path}/qdrant/docs", f"lancedb://{tmp_path}/lance/docs"]


def _stored_ids(url):
    store = open_store(url)
    ids = sorted(f"d{i:03d}" for i in range(N_DOCS))
    return len(store), store.contains(ids)


def _assert_same_ranking(got, want, atol=1e-5):
    """Same scores (to ``atol``) rank by rank, and the same hits with their evidence, where hits whose
    scores tie are compared as a set: the corpus's 11-word vocabulary makes duplicate chunks, whose scores
    tie, and a tie has no order to keep (seen on a Zen 3: the stores and the index listed two tied
    documents the other way round, their scores 1e-6 apart). A tie that runs to the end of a row may let a
    different tied document in at rank k, so that last group is held to its scores only."""
    def evidence(hits, a, b):
        return sorted((h.id, h.chunk, h.start_char, h.end_char) for h in hits[a:b])

    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose([h.score for h in g], [h.score for h in w], atol=atol)
        ends = [i for i in range(1, len(w)) if abs(w[i].score - w[i - 1].score) > atol]  # where a group ends
        for a, b in zip([0, *ends], ends):  # every group but the last: the same hits, in any order
            assert evidence(g, a, b) == evidence(w, a, b), (a, b, g, w)


def test_push_equals_the_index_of_the_same_output(tmp_path, corpus_output, capsys):
    index = DiceIndex.from_corpus(corpus_output)
    queries = np.asarray(index.documents[:12]) + 0.05
    for url in _urls(tmp_path):
        assert main(["index", "push", str(corpus_output), "--to", url, "--batch-size", str(BATCH), "--quiet"]) == 0
        assert f"wrote {N_DOCS} documents" in capsys.readouterr().err
        store = open_store(url)
        assert len(store) == N_DOCS and store.model == index.model and store.encoder_options == index.encoder_options
        for scoring in ("dice", "maxsim"):
            _assert_same_ranking(store.search(queries, 5, scoring), index.search(queries, 5, scoring))
        del store
        assert main(["search", url, "river stone cloud", "-k", "3", "--json", "--device", "cpu"]) == 0
        printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        hits = DiceIndex.from_corpus(corpus_output).search(["river stone cloud"], 3)[0]  # the recorded encoder
        assert [(p["id"], p["chunk"], p["start_char"]) for p in printed] == [(h.id, h.chunk, h.start_char) for h in hits]
        assert main(["index", "push", str(corpus_output), "--to", url]) == 2
        assert "already holds 240 documents: pass --resume" in capsys.readouterr().err
        assert main(["index", "push", str(corpus_output), "--to", url, "--resume", "--quiet"]) == 0
        assert "wrote 0 documents, skipped 240" in capsys.readouterr().err


def test_a_resumed_push_of_a_re_encoded_corpus_updates_what_changed(tmp_path, corpus_output, model_folder,  # noqa: F811
                                                                    capsys):
    """A shard whose ids are all stored was skipped by --resume whatever it held now: an edited, re-encoded
    corpus kept the old vectors and spans under the same ids. Only shards stored as they are are skipped."""
    src = tmp_path / "in.jsonl"
    lines = src.read_text(encoding="utf-8").splitlines()
    edited = json.loads(lines[45])  # in the second shard
    edited["text"] = "  a brand new text about the blue song  "
    lines[45] = json.dumps(edited)
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    again = tmp_path / "out2"
    assert main(["encode", str(tmp_path / "v2" / "in.jsonl"), "-o", f"{again}/", "--chunks", "--chunk-size", "8",
                 "--model", str(model_folder), "--device", "cpu", "--shard-rows", str(SHARD_ROWS), "--id-field", "id",
                 "--quiet"]) == 0
    want = DiceIndex.from_corpus(again)
    for url in _urls(tmp_path):
        assert main(["index", "push", str(corpus_output), "--to", url, "--quiet"]) == 0
        capsys.readouterr()
        assert main(["index", "push", str(again), "--to", url, "--resume", "--quiet"]) == 0
        assert f"wrote {SHARD_ROWS} documents, skipped {N_DOCS - SHARD_ROWS}" in capsys.readouterr().err
        store = open_store(url)
        assert store.holds(*_arrays(want, [45])) and not store.holds(*_arrays(DiceIndex.from_corpus(corpus_output), [45]))
        hit = store.search(np.asarray(want.documents[45:46]), 1, "dice")[0][0]
        assert (hit.id, hit.start_char, hit.end_char) == ("d045", 2, 38)  # the new text's span


def _arrays(index, rows):
    """(ids, documents, chunks, chunk_document, start, end, tokens) of the documents ``rows`` of ``index``."""
    cu = np.asarray(index.cu_doc_chunks)
    take = np.concatenate([np.arange(cu[r], cu[r + 1]) for r in rows])
    doc_of = np.repeat(np.arange(len(rows)), [cu[r + 1] - cu[r] for r in rows])
    return ([index.ids[r] for r in rows], np.asarray(index.documents)[rows], np.asarray(index.chunks)[take], doc_of,
            np.asarray(index.chunk_start_char)[take], np.asarray(index.chunk_end_char)[take],
            np.asarray(index.chunk_tokens)[take])


@pytest.mark.parametrize("which", [0, 1], ids=["qdrant", "lancedb"])
def test_a_push_killed_midway_resumes_to_every_document_once(tmp_path, corpus_output, capsys, which):
    url = _urls(tmp_path)[which]
    module, cls = [("dice_fast.index.qdrant_store", "QdrantStore"), ("dice_fast.index.lance_store", "LanceStore")][which]
    script = textwrap.dedent(f"""
        import os, signal
        from {module} import {cls} as Store
        from dice_fast.cli import main
        real, calls = Store._write, []
        def dying(self, batch):
            calls.append(1)
            if len(calls) == 7:  # inside the third shard (40 rows = 3 writes of at most 16)
                os.kill(os.getpid(), signal.SIGKILL)
            real(self, batch)
        Store._write = dying
        main(["index", "push", {str(corpus_output)!r}, "--to", {url!r}, "--batch-size", "{BATCH}", "--quiet"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()},
                          timeout=300, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    count, present = _stored_ids(url)
    assert 0 < count < N_DOCS and count == sum(present)  # cut off inside the third shard
    assert main(["index", "push", str(corpus_output), "--to", url, "--resume", "--batch-size", str(BATCH),
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "skipped 80 already stored" in err and f"wrote {N_DOCS - 80} documents" in err
    count, present = _stored_ids(url)
    assert count == N_DOCS and all(present)
    index = DiceIndex.from_corpus(corpus_output)
    queries = np.asarray(index.documents[:8])
    _assert_same_ranking(open_store(url).search(queries, 5, "maxsim"), index.search(queries, 5, "maxsim"))


@pytest.mark.parametrize("which", [0, 1], ids=["qdrant", "lancedb"])
def test_a_database_that_cannot_take_a_write_is_one_line(tmp_path, corpus_output, capsys, monkeypatch, which):
    """A full disk under `index push` ended in a traceback and exit 1 ("a bug"): lance's RuntimeError,
    the local Qdrant's sqlite3 error. Now one line naming the store and the cause, exit 2."""
    import sqlite3

    from dice_fast.index.lance_store import LanceStore
    from dice_fast.index.qdrant_store import QdrantStore

    url = _urls(tmp_path)[which]
    store, failure = [(QdrantStore, sqlite3.OperationalError("database or disk is full")),
                      (LanceStore, RuntimeError("lance error: LanceError(IO): No space left on device (os error 28)"))][which]

    def full(self, batch):
        raise failure

    monkeypatch.setattr(store, "_write", full)
    assert main(["index", "push", str(corpus_output), "--to", url, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("dice-fast: error: cannot write to ") and str(failure) in err, err


def test_push_usage_and_a_store_of_another_model_are_refused(tmp_path, corpus_output, capsys):
    url = _urls(tmp_path)[1]
    assert main(["index", "push", str(corpus_output)]) == 2
    assert "usage: dice-fast index push OUT --to URL" in capsys.readouterr().err
    assert main(["index", "push", str(corpus_output), "--to", "milvus://x/y"]) == 2
    assert "is not one of qdrant://" in capsys.readouterr().err
    assert main(["index", str(corpus_output), "--to", url]) == 2
    assert "give one INPUT with -o" in capsys.readouterr().err
    open_store(url, dim=32, model="/elsewhere/model", encoder_options={"chunk_size": 8})
    assert main(["index", "push", str(corpus_output), "--to", url, "--quiet"]) == 2
    assert "holds vectors with" in capsys.readouterr().err


def test_an_id_repeated_across_shards_is_refused_naming_both_files(tmp_path, model_folder, capsys):  # noqa: F811
    src = tmp_path / "dup.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i % 5}", "text": f"river stone {i}"}) + "\n" for i in range(8)))
    out = tmp_path / "dup"
    assert main(["encode", str(src), "-o", f"{out}/", "--chunks", "--chunk-size", "8", "--model", str(model_folder),
                 "--device", "cpu", "--shard-rows", "4", "--id-field", "id", "--quiet"]) == 0
    said = r"duplicate id 'd0': .*part-00000.parquet row 0 and .*part-00001.parquet row 1"
    with pytest.raises(ValueError, match=said):
        DiceIndex.from_corpus(out)
    url = _urls(tmp_path)[1]
    assert main(["index", "push", str(out), "--to", url, "--quiet"]) == 2
    assert re.search(said, capsys.readouterr().err)
    assert len(open_store(url)) == 0  # refused before anything was written


def test_an_unfinished_or_partly_split_output_is_neither_indexed_nor_pushed(tmp_path, model_folder, capsys):  # noqa: F811
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"river stone {i} cloud"}) + "\n" for i in range(12)))
    out = tmp_path / "out"
    assert main(["encode", str(src), "-o", f"{out}/", "--chunks", "--chunk-size", "8", "--model", str(model_folder),
                 "--device", "cpu", "--shard", "0/2", "--quiet"]) == 0  # split 1 of 2 never ran
    url = f"lancedb://{tmp_path}/lance/docs"
    with pytest.raises(ValueError, match=r"not the 2 splits of one job.*index a finished output"):
        DiceIndex.from_corpus(out)
    assert main(["index", "push", str(out), "--to", url]) != 0
    assert "not the 2 splits of one job" in capsys.readouterr().err
    assert not (tmp_path / "lance").exists() or len(open_store(url)) == 0
    assert main(["encode", str(src), "-o", f"{out}/", "--chunks", "--chunk-size", "8", "--model", str(model_folder),
                 "--device", "cpu", "--shard", "1/2", "--quiet"]) == 0
    manifest = out / "manifest-1of2.json"
    manifest.write_text(manifest.read_text().replace('"status": "complete"', '"status": "running"'))
    with pytest.raises(ValueError, match=r"split 1/2 is not complete"):
        DiceIndex.from_corpus(out)
    manifest.write_text(manifest.read_text().replace('"status": "running"', '"status": "complete"'))
    assert len(DiceIndex.from_corpus(out)) == 12


def test_an_output_without_chunks_is_refused_before_the_store_is_made(tmp_path, model_folder, capsys):  # noqa: F811
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"river stone {i}"}) + "\n" for i in range(3)))
    for out in ("plain.parquet", "plain/"):
        assert main(["encode", str(src), "-o", str(tmp_path / out), "--model", str(model_folder), "--device", "cpu",
                     "--id-field", "id", "--quiet"]) == 0
        for url in _urls(tmp_path):
            capsys.readouterr()
            assert main(["index", "push", str(tmp_path / out), "--to", url]) == 2  # with its progress bar
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "no chunk_embeddings, chunk_start_char" in err, err
            assert "encode with --chunks" in err
            assert not (tmp_path / "qdrant").exists() and not (tmp_path / "lance").exists()  # no empty store


def test_a_damaged_or_missing_shard_is_refused_before_the_store_is_made(tmp_path, corpus_output, capsys):
    """Checking every shard's sha256 moved into the push, after the store was opened: a damaged output
    left an empty store recording its model; a missing shard read as "no dice_fast options"."""
    shard = corpus_output / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only its sha256 tells
    shard.write_bytes(bytes(data))
    for url in _urls(tmp_path):
        capsys.readouterr()
        assert main(["index", "push", str(corpus_output), "--to", url]) == 2
        assert f"{shard}: damaged (its sha256 is not the" in capsys.readouterr().err
        assert not (tmp_path / "qdrant").exists() and not (tmp_path / "lance").exists()  # no empty store
    shard.unlink()
    for url in _urls(tmp_path):
        capsys.readouterr()
        assert main(["index", "push", str(corpus_output), "--to", url]) == 2
        assert f"{shard}: missing (its manifest lists it)" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="missing"):
        DiceIndex.from_corpus(corpus_output)
