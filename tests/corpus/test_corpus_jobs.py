"""Sharded corpus jobs: splits that add up to one run, resume from the last committed shard, and refusal
to resume with other options or another input (in-process; the signal and kill -9 runs are in
test_corpus_signals.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from corpus_util import corpus_docs, interrupted_copy, write_jsonl
from dice_fast.cli import main
from dice_fast.corpus import load_embeddings
from dice_fast.errors import InputError

OPTS = ["--chunk-size", "16", "-q", "--id-field", "id"]


def _run(src, out, *extra):
    return main(["encode", str(src), "-o", str(out), *OPTS, *extra])


@pytest.fixture
def done(tmp_path, cached_encoders):
    """A complete reference run: 37 documents (one blank line among them) in shards of 8."""
    docs = corpus_docs(37, seed=5)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    src.write_text(src.read_text().replace("\n", "\n\n", 1), encoding="utf-8")
    assert _run(src, tmp_path / "ref", "--shard-rows", "8") == 0
    return src, tmp_path / "ref", load_embeddings(tmp_path / "ref")


def test_splits_add_up_to_one_run(done, tmp_path):
    src, _, (ids, vecs) = done
    split = tmp_path / "split"
    for i in range(3):
        assert _run(src, split, "--shard", f"{i}/3", "--shard-rows", "5") == 0
    names = sorted(p.name for p in split.iterdir())
    assert names[:3] == ["manifest-0of3.json", "manifest-1of3.json", "manifest-2of3.json"]
    assert "part-1of3-00002.parquet" in names
    ids2, vecs2 = load_embeddings(split)
    assert ids2 == ids == [f"doc{i:04d}" for i in range(37)]
    np.testing.assert_allclose(vecs2, vecs, atol=1e-5, rtol=0)
    # a split resumes on its own: split 1 interrupted after its first shard
    manifest = json.loads((split / "manifest-1of3.json").read_text())
    manifest.update(status="running", shards=manifest["shards"][:1])
    (split / "manifest-1of3.json").write_text(json.dumps(manifest), encoding="utf-8")
    (split / ".part-1of3-00001.parquet.0a0b0c0d.tmp").write_bytes(b"partial")
    assert _run(src, split, "--shard", "1/3", "--shard-rows", "5", "--resume") == 0
    assert sorted(p.name for p in split.iterdir()) == names
    ids3, vecs3 = load_embeddings(split)
    assert ids3 == ids
    np.testing.assert_allclose(vecs3, vecs, atol=1e-5, rtol=0)
    # a split of another count contradicts the folder
    assert _run(src, split, "--shard", "0/2") == 2
    # a split re-run with other options (its siblings not): the folder no longer loads as one job
    assert _run(src, split, "--shard", "1/3", "--shard-rows", "5", "--aggregation", "max", "--overwrite") == 0
    with pytest.raises(InputError, match=r"split 1/3 was made with other settings than split 0/3 "
                                         r"\(options.aggregation\)"):
        load_embeddings(split)


def test_resume_continues_after_the_last_committed_shard(done, tmp_path, capsys):
    """The state a kill -9 can leave: two shards committed, a third renamed but not yet listed, and a
    temporary file; --resume rewrites the rest and equals the clean run."""
    src, ref, (ids, vecs) = done
    out = tmp_path / "out"
    out.mkdir()
    manifest = json.loads((ref / "manifest.json").read_text())
    for s in manifest["shards"][:3]:
        (out / s["file"]).write_bytes((ref / s["file"]).read_bytes())
    (out / ".part-00003.parquet.1a2b3c4d.tmp").write_bytes(b"partial")
    (out / "notes.txt").write_text("not ours", encoding="utf-8")
    manifest.update(status="running", shards=manifest["shards"][:2], rows=16)
    del manifest["summary"]
    (out / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    capsys.readouterr()
    assert _run(src, out, "--shard-rows", "8", "--resume") == 0
    summary = capsys.readouterr().out
    assert "encoded 21 documents" in summary and "16 already committed (resumed)" in summary, summary
    got_ids, got = load_embeddings(out)
    assert got_ids == ids
    np.testing.assert_allclose(got, vecs, atol=1e-5, rtol=0)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "notes.txt"] + [f"part-0000{k}.parquet"
                                                                                      for k in range(5)]
    # resuming a complete job does nothing
    assert _run(src, out, "--shard-rows", "8", "--resume") == 0
    assert "nothing to do" in capsys.readouterr().out


def test_a_killed_single_file_runs_temporaries_go_with_the_next_run(done, tmp_path):
    """kill -9 leaves ``.v.npy.XXXXXXXX.tmp`` and ``.v.ids.txt.XXXXXXXX.tmp`` (as big as the partial output)
    beside a .npy output; the next run on that file removes them once it holds the lock (another file's
    temporaries and files not ours stay)."""
    src = done[0]
    out = tmp_path / "v.npy"
    left = [tmp_path / ".v.npy.0a1b2c3d.tmp", tmp_path / ".v.ids.txt.4e5f6a7b.tmp"]
    kept = [tmp_path / ".w.npy.0a1b2c3d.tmp", tmp_path / ".v.npy.notours.tmp"]
    for p in left + kept:
        p.write_bytes(b"partial")
    assert _run(src, out) == 0
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept)
    assert out.exists() and (tmp_path / "v.ids.txt").exists()


@pytest.mark.parametrize("extra,message", [
    (["--shard-rows", "8", "--chunk-size", "32"], "options.chunk_size is 32, was 16"),
    (["--shard-rows", "8", "--aggregation", "max"], "options.aggregation is 'max', was 'mean'"),
    (["--shard-rows", "4"], "shard_rows is 4, was 8"),
    (["--shard-rows", "8", "--queries"], "kind is 'queries', was 'documents'"),
    (["--shard-rows", "8", "--dtype", "bfloat16"], "options.dtype is 'bfloat16', was None"),  # precision: pinned
])
def test_resume_with_other_options_is_refused(done, tmp_path, capsys, extra, message):
    src, ref, _ = done
    out = tmp_path / "out"
    before = interrupted_copy(ref, out)
    capsys.readouterr()
    assert _run(src, out, "--resume", *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot resume" in err and message in err, err
    assert sorted(p.name for p in out.iterdir()) == before


def test_resume_may_change_what_changes_only_speed(done, tmp_path, capsys):
    """A job that ran out of memory resumes with a smaller batch budget (what its error advises), and
    with or without dedup or the compiled forward: options of role "speed" change no vector."""
    src, ref, (ids, vecs) = done
    out = tmp_path / "out"
    interrupted_copy(ref, out)
    capsys.readouterr()
    assert _run(src, out, "--shard-rows", "8", "--resume", "--max-batch-tokens", "64", "--no-dedup",
                "--pooling-impl", "torch", "--pipeline", "off") == 0
    assert "already committed (resumed)" in capsys.readouterr().out
    got_ids, got = load_embeddings(out)
    assert got_ids == ids
    np.testing.assert_allclose(got, vecs, atol=1e-5, rtol=0)


def test_resume_with_a_changed_input_is_refused(done, tmp_path, capsys):
    src, ref, _ = done
    out = tmp_path / "out"
    before = interrupted_copy(ref, out)
    text = src.read_text(encoding="utf-8")
    grown = tmp_path / "grown" / "c.jsonl"
    grown.parent.mkdir()
    grown.write_text(text + '{"id": "new", "text": "one more"}\n', encoding="utf-8")
    capsys.readouterr()
    assert _run(grown, out, "--resume", "--shard-rows", "8") == 2
    assert "input.files[0].size is" in capsys.readouterr().err
    # same size, one committed document edited: caught by the shard's input hash
    edited = tmp_path / "edited" / "c.jsonl"
    edited.parent.mkdir()
    first = json.loads(text.splitlines()[0])
    edited.write_text(text.replace(first["text"], first["text"][::-1], 1), encoding="utf-8")
    assert _run(edited, out, "--resume", "--shard-rows", "8") == 2
    err = capsys.readouterr().err
    assert "the input changed: the documents of committed shard part-00000.parquet (ids doc0000 .. doc0007)" in err
    assert sorted(p.name for p in out.iterdir()) == before


def test_committed_shard_corrupted_in_place_is_refused(done, tmp_path, capsys):
    """Same size, different bytes (a flipped byte inside a committed shard): caught by its sha256."""
    src, ref, _ = done
    out = tmp_path / "out"
    interrupted_copy(ref, out)
    shard = out / "part-00000.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    assert _run(src, out, "--resume", "--shard-rows", "8") == 2
    assert f"committed shard {shard}: damaged (its sha256 is not the" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before  # nothing removed or written


def test_committed_shard_missing_is_refused(done, tmp_path, capsys):
    src, ref, _ = done
    out = tmp_path / "out"
    interrupted_copy(ref, out)
    (out / "part-00001.parquet").unlink()
    assert _run(src, out, "--resume", "--shard-rows", "8") == 2
    assert f"committed shard {out / 'part-00001.parquet'}: missing (its manifest lists it)" in capsys.readouterr().err
