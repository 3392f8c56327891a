"""Earlier outputs of ``dice-fast encode``: an ``--overwrite`` of a shard folder that fails or is stopped
leaves the previous output as it was (one that completes leaves only its own files), and a folder input
never reads the outputs found in it (ids files, shards, ``.parquet`` outputs) as documents."""

from __future__ import annotations

import json
import os
import re

import pytest

from corpus_util import corpus_docs, write_jsonl
from dice_fast.cli import main
from dice_fast.corpus import load_embeddings

OPTS = ["--chunk-size", "16", "-q", "--id-field", "id", "--shard-rows", "4"]


class Died(BaseException):
    """The process dying at this point (raised past every ``except Exception``, as ``kill -9`` would stop it)."""


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.fixture
def previous(tmp_path, cached_encoders):
    """A complete shard folder of 10 documents (3 shards) and its files' bytes."""
    src = write_jsonl(tmp_path / "old.jsonl", corpus_docs(10, seed=7))
    assert main(["encode", str(src), "-o", str(tmp_path / "out"), *OPTS]) == 0
    return tmp_path / "out", _files(tmp_path / "out")


def test_a_failed_overwrite_keeps_the_previous_output(tmp_path, capsys, previous):
    out, before = previous
    bad = write_jsonl(tmp_path / "bad.jsonl", corpus_docs(9, seed=8))
    with open(bad, "a", encoding="utf-8") as fh:
        fh.write('{"id": "x", "text": "unterminated\n')  # line 10, after two shards' worth of documents
    capsys.readouterr()
    assert main(["encode", str(bad), "-o", str(out), *OPTS, "--overwrite"]) == 2
    assert "bad.jsonl:10" in capsys.readouterr().err
    assert _files(out) == before  # nothing removed, replaced or left behind
    assert load_embeddings(out)[0] == [f"doc{i:04d}" for i in range(10)]


def test_a_stopped_overwrite_keeps_the_previous_output(tmp_path, capsys, monkeypatch, previous):
    import dice_fast.corpus.outputs as outputs

    out, before = previous
    real, calls = outputs.ShardWriter.commit_shard, []

    def stopped_after_one(self):
        real(self)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(outputs.ShardWriter, "commit_shard", stopped_after_one)
    src = write_jsonl(tmp_path / "new.jsonl", corpus_docs(12, seed=9))
    capsys.readouterr()
    assert main(["encode", str(src), "-o", str(out), *OPTS, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"no output written; {out} still holds the previous output" in err, err
    assert _files(out) == before


def test_a_completed_overwrite_leaves_only_its_own_files(tmp_path, previous):
    out, _ = previous
    src = write_jsonl(tmp_path / "new.jsonl", corpus_docs(5, seed=9), ids=[f"new{i}" for i in range(5)])
    assert main(["encode", str(src), "-o", str(out), *OPTS, "--overwrite"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "manifest.json" and len(names) == 3, names
    assert all(re.fullmatch(r"part-0000[01]-[0-9a-f]{8}[.]parquet", n) for n in names[1:]), names  # not the old names
    assert load_embeddings(out)[0] == [f"new{i}" for i in range(5)]
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    assert main(["encode", str(src), "-o", str(out), *OPTS, "--overwrite"]) == 0  # and again over those names
    assert len(list(out.iterdir())) == 3 and load_embeddings(out)[0] == [f"new{i}" for i in range(5)]


@pytest.mark.parametrize("dies_at", [("replace", 1), ("replace", 2), ("replace", 3), ("unlink", 1), ("unlink", 3)])
def test_an_overwrite_killed_while_committing_leaves_the_old_or_the_new_output(tmp_path, monkeypatch, previous,
                                                                                dies_at):
    """The manifest is the commit point: the new shards are renamed beside the old ones (under names
    the old output does not use), the manifest replaced, and only then the old shards removed. A death
    at any of those steps leaves a folder that loads whole, and a second run tidies it."""
    out, before = previous
    old_ids = [f"doc{i:04d}" for i in range(10)]
    new_ids = [f"new{i}" for i in range(5)]
    src = write_jsonl(tmp_path / "new.jsonl", corpus_docs(5, seed=9), ids=new_ids)
    kind, n = dies_at
    calls = []
    real = getattr(os, kind)

    def dying(path, *args, **kw):
        name = os.path.basename(args[0] if kind == "replace" else path)
        if name in before or name.startswith("part-"):  # not the probe, lock or temporary files
            calls.append(name)
            if len(calls) == n:
                raise Died
        return real(path, *args, **kw)

    monkeypatch.setattr(os, kind, dying)
    with pytest.raises(Died):
        main(["encode", str(src), "-o", str(out), *OPTS, "--overwrite"])
    monkeypatch.undo()
    # renames: the two new shards, then the manifest; removals: the three old shards
    assert len(calls) == n and calls[-1].startswith("manifest" if dies_at == ("replace", 3) else "part-"), calls
    assert load_embeddings(out)[0] == (new_ids if kind == "unlink" else old_ids)
    if kind == "replace":  # stopped before its commit (in this process): the old files alone, as they were
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(["encode", str(src), "-o", str(out), *OPTS, "--overwrite"]) == 0
    assert len(list(out.iterdir())) == 3 and load_embeddings(out)[0] == new_ids


def test_an_unsplit_overwrite_of_a_split_output_killed_after_its_commit_reads_as_the_new_output(
        tmp_path, monkeypatch, cached_encoders):
    """The old split manifests stay until removed after the commit: the new manifest names them
    (``replaces``) and readers skip them (they read "split manifests ... are not the 2 splits of one job")."""
    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(6, seed=7))
    out = tmp_path / "out"
    for split in ("0/2", "1/2"):
        assert main(["encode", str(src), "-o", str(out), *OPTS, "--shard", split]) == 0
    new = write_jsonl(tmp_path / "new.jsonl", corpus_docs(5, seed=9), ids=[f"new{i}" for i in range(5)])
    real = os.unlink

    def dying(path, *args, **kw):
        if os.path.basename(path).startswith(("manifest-", "part-0of2", "part-1of2")):
            raise Died
        return real(path, *args, **kw)

    monkeypatch.setattr(os, "unlink", dying)
    with pytest.raises(Died):
        main(["encode", str(new), "-o", str(out), *OPTS, "--overwrite"])
    monkeypatch.undo()
    assert sorted(json.loads((out / "manifest.json").read_text())["replaces"]) == ["manifest-0of2.json",
                                                                                     "manifest-1of2.json"]
    assert (out / "manifest-0of2.json").exists()  # killed before removing it
    assert load_embeddings(out)[0] == [f"new{i}" for i in range(5)]
    manifest = json.loads((out / "manifest.json").read_text())  # as 0.2.0 wrote it: the names alone
    manifest["replaces"] = sorted(manifest["replaces"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert load_embeddings(out)[0] == [f"new{i}" for i in range(5)]  # it read "are not the 2 splits of one job"
    from dice_fast.manifests import file_sha256

    for split in ("manifest-0of2.json", "manifest-1of2.json"):  # 0.2.0 splits that replaced an unsplit output
        old = json.loads((out / split).read_text())
        (out / split).write_text(json.dumps({**old, "replaces": ["manifest.json"]}))
    manifest["replaces"] = {n: file_sha256(out / n) for n in ("manifest-0of2.json", "manifest-1of2.json")}
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert load_embeddings(out)[0] == [f"new{i}" for i in range(5)]  # the stale splits' list hides nothing
    assert main(["encode", str(new), "-o", str(out), *OPTS, "--overwrite"]) == 0
    assert not list(out.glob("*of2*")) and load_embeddings(out)[0] == [f"new{i}" for i in range(5)]

    # splits replacing that unsplit output, then an unsplit one replacing them, killed again: each names
    # what it replaced by sha256, so the splits' stale "replaces" of the old manifest.json hides nothing
    for split in ("0/2", "1/2"):
        assert main(["encode", str(src), "-o", str(out), *OPTS, "--shard", split, "--overwrite"]) == 0
    assert load_embeddings(out)[0] == [f"doc{i:04d}" for i in range(6)]
    monkeypatch.setattr(os, "unlink", dying)
    with pytest.raises(Died):
        main(["encode", str(new), "-o", str(out), *OPTS, "--overwrite"])
    monkeypatch.undo()
    assert load_embeddings(out)[0] == [f"new{i}" for i in range(5)]


def test_a_folder_input_skips_earlier_outputs_in_it(tmp_path, capsys, cached_encoders):
    corp = tmp_path / "corp"
    corp.mkdir()
    (corp / "a.txt").write_text("one\ntwo\n", encoding="utf-8")
    (corp / "notes.ids.txt").write_text("#not an ids record\nthree\n", encoding="utf-8")  # a document file
    expected = ["a.txt:1", "a.txt:2", "notes.ids.txt:1", "notes.ids.txt:2"]
    for out in ("v.npy", "v.parquet", "out/", "w.npy"):  # each run meets the outputs of the runs before it
        assert main(["encode", str(corp), "-o", str(corp / out), "-q"]) == 0, capsys.readouterr().err
        ids, vecs = load_embeddings(corp / out)
        assert ids == expected and vecs.shape == (4, 384), out


def test_an_output_read_back_and_given_texts_is_input_again(tmp_path, capsys, cached_encoders):
    """pyarrow keeps a table's metadata: a user's Parquet made from an output (with a text column added)
    still carries dice_fast's key, and was skipped silently as one of our outputs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    corp = tmp_path / "corp"
    corp.mkdir()
    (corp / "a.txt").write_text("one\ntwo\n", encoding="utf-8")
    assert main(["encode", str(corp / "a.txt"), "-o", str(tmp_path / "v.parquet"), "-q"]) == 0
    table = pq.read_table(tmp_path / "v.parquet")
    pq.write_table(table.append_column("text", pa.array(["three", "four"])), corp / "mine.parquet")
    assert b"dice_fast" in pq.read_schema(corp / "mine.parquet").metadata
    assert main(["encode", str(corp), "-o", str(tmp_path / "w.npy"), "-q"]) == 0, capsys.readouterr().err
    assert len(load_embeddings(tmp_path / "w.npy")[0]) == 4
