"""Duplicate ids in corpus jobs: `id_set.IdSet` / `DuplicateIds` against a plain Python set, and
the job's warning and manifest count (resumed shards included)."""

from __future__ import annotations

import json
import random

import numpy as np

from corpus_util import corpus_docs, interrupted_copy, write_jsonl
from dice_fast.cli import main
from dice_fast.corpus import load_embeddings
from dice_fast.corpus.ids import DuplicateIds
from dice_fast.id_set import IdSet

OPTS = ["--chunk-size", "16", "-q", "--id-field", "id"]


def test_idset_matches_a_python_set_over_many_blocks():
    rng = random.Random(0)
    pool = [f"id{i}" for i in range(3000)] + ["", "é", "a\u0000b", "x" * 10_000]
    seen_set, ids = set(), IdSet()
    for _ in range(400):  # blocks of 0-40 ids, repeats within and across blocks; runs merge many times
        block = [rng.choice(pool) for _ in range(rng.randint(0, 40))]
        expected = []
        for i in block:
            if i in seen_set:
                expected.append(i)
            seen_set.add(i)
        assert ids.add(block) == expected
    assert ids.count == len(seen_set)


def test_duplicate_ids_counts_and_names_the_first_few():
    dup = DuplicateIds()
    dup.add(["a", "b", "a"])
    dup.add(["c", "b", "b", "d", "e", "f", "c", "g", "d", "f", "e", "g"])
    assert dup.count == 8  # a; then b, b, c, d, f, e, g
    assert dup.examples == ["a", "b", "c", "d", "f"]
    assert dup.message().startswith("8 documents have an id that occurred earlier in the input ('a', 'b', 'c', 'd', 'f', ...)")
    single = DuplicateIds()
    single.add(["a", "a", "a"])
    assert single.message().startswith("2 documents have an id that occurred earlier in the input ('a');")


def test_job_warns_about_duplicate_ids_and_keeps_every_row(tmp_path, capsys, cached_encoders):
    docs = corpus_docs(12, seed=3)
    ids = [f"doc{i % 9}" for i in range(12)]  # doc0, doc1, doc2 occur twice
    src = write_jsonl(tmp_path / "c.jsonl", docs, ids)
    out = tmp_path / "out"
    assert main(["encode", str(src), "-o", str(out), *OPTS, "--shard-rows", "5"]) == 0
    err = capsys.readouterr().err
    assert "dice-fast: warning: 3 documents have an id that occurred earlier in the input ('doc0', 'doc1', 'doc2')" in err
    got_ids, vecs = load_embeddings(out)
    assert got_ids == ids and len(vecs) == 12
    assert json.loads((out / "manifest.json").read_text())["summary"]["duplicate_ids"] == 3


def test_resume_counts_duplicates_of_committed_shards(tmp_path, capsys, cached_encoders):
    """An id committed before the interruption and repeated after it is still found."""
    docs = corpus_docs(12, seed=4)
    ids = [f"doc{i}" for i in range(10)] + ["doc1", "doc7"]
    src = write_jsonl(tmp_path / "c.jsonl", docs, ids)
    ref = tmp_path / "ref"
    assert main(["encode", str(src), "-o", str(ref), *OPTS, "--shard-rows", "4"]) == 0
    out = tmp_path / "out"
    interrupted_copy(ref, out, shards=2)  # doc0..doc7 committed
    capsys.readouterr()
    assert main(["encode", str(src), "-o", str(out), *OPTS, "--shard-rows", "4", "--resume"]) == 0
    assert "2 documents have an id that occurred earlier in the input ('doc1', 'doc7')" in capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["summary"]["duplicate_ids"] == 2
    np.testing.assert_array_equal(load_embeddings(out)[1], load_embeddings(ref)[1])
