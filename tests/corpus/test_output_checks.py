"""Outputs of ``dice-fast encode`` in their surroundings: Ctrl-C while resuming names what is kept, a file
output inside the input folder is not read back as input, upper-case suffixes and empty folders load,
and `finished_manifests` refuses unfinished outputs (for `load_embeddings` and the index)."""

from __future__ import annotations

import errno
import hashlib
import json
import re

import pytest

from corpus_util import corpus_docs, interrupted_copy, write_jsonl
from dice_fast.cli import main
from dice_fast.corpus import load_embeddings
from dice_fast.manifests import finished_manifests

OPTS = ["--chunk-size", "16", "-q", "--id-field", "id"]


def test_ctrl_c_while_resuming_names_the_committed_shards(tmp_path, capsys, monkeypatch, cached_encoders):
    import dice_fast.corpus.job as job

    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(12, seed=3))
    assert main(["encode", str(src), "-o", str(tmp_path / "ref"), "--shard-rows", "4", *OPTS]) == 0
    out = tmp_path / "out"
    kept = interrupted_copy(tmp_path / "ref", out, shards=2)

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "load_encoder", interrupted)  # Ctrl-C while the model loads
    capsys.readouterr()
    assert main(["encode", str(src), "-o", str(out), "--shard-rows", "4", *OPTS, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "8 rows in 2 shards are committed" in err and "continue with --resume" in err, err
    assert sorted(p.name for p in out.iterdir()) == kept


@pytest.mark.parametrize("name", ["vecs.npy", "vecs.parquet"])
def test_a_file_output_inside_the_input_folder_is_not_read_as_input(tmp_path, capsys, cached_encoders, name):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("one\ntwo\n", encoding="utf-8")
    for extra in ([], ["--overwrite"]):
        assert main(["encode", str(data), "-o", str(data / name), "-q", *extra]) == 0, capsys.readouterr().err
        ids, vecs = load_embeddings(data / name)
        assert ids == ["a.txt:1", "a.txt:2"] and vecs.shape == (2, 384)


@pytest.mark.parametrize("name", ["up.NPY", "up.PARQUET"])
def test_upper_case_suffixes_load(tmp_path, cached_encoders, name):
    src = tmp_path / "d.txt"
    src.write_text("one\ntwo\n", encoding="utf-8")
    assert main(["encode", str(src), "-o", str(tmp_path / name), "-q"]) == 0
    ids, vecs = load_embeddings(tmp_path / name)
    assert ids == ["1", "2"] and vecs.shape == (2, 384)


def test_an_empty_output_has_the_model_width_in_every_form(tmp_path, cached_encoders):
    src = tmp_path / "blank.txt"
    src.write_text("\n  \n", encoding="utf-8")
    runs = [("e.npy", []), ("e.parquet", []), ("folder/", []), ("split/", ["--shard", "0/2"]),
            ("split/", ["--shard", "1/2"])]
    for out, extra in runs:
        assert main(["encode", str(src), "-o", str(tmp_path / out), "-q", "--truncate-dim", "8", *extra]) == 0
    for out in ("e.npy", "e.parquet", "folder/", "split/"):
        ids, vecs = load_embeddings(tmp_path / out)
        assert ids == [] and vecs.shape == (0, 8), out


def test_finished_manifests_refuse_unfinished_outputs(tmp_path, cached_encoders):
    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(6, seed=4))
    for i in range(2):
        assert main(["encode", str(src), "-o", str(tmp_path / "split"), "--shard", f"{i}/2", *OPTS]) == 0
    assert main(["encode", str(src), "-o", str(tmp_path / "v.npy"), *OPTS]) == 0
    assert [m["split"]["index"] for m in finished_manifests(tmp_path / "split")] == [0, 1]
    (tmp_path / "split" / "manifest-1of2.json").rename(tmp_path / "manifest-1of2.json")
    with pytest.raises(ValueError, match=r"are not the 2 splits of one job"):
        finished_manifests(tmp_path / "split")
    manifest = json.loads((tmp_path / "manifest-1of2.json").read_text())
    (tmp_path / "split" / "manifest-1of2.json").write_text(json.dumps({**manifest, "status": "running"}))
    with pytest.raises(ValueError, match=r"split 1/2 is not complete \(3 rows committed\)"):
        finished_manifests(tmp_path / "split")
    with pytest.raises(ValueError, match=r"split 1/2 is not complete"):
        load_embeddings(tmp_path / "split")
    with pytest.raises(ValueError, match="nothing does not exist"):
        load_embeddings(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no manifest"):
        load_embeddings(tmp_path / "empty")


@pytest.mark.parametrize("out", ["v.npy", "v.parquet", "shards/"])
def test_a_full_disk_is_named_with_the_output_and_leaves_nothing(tmp_path, capsys, monkeypatch, cached_encoders, out):
    """numpy and pyarrow say only "No space left on device" (no file): the error names the output."""
    import dice_fast.corpus.outputs as outputs

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.NpyWriter, "write", full)
    monkeypatch.setattr(outputs._ParquetStream, "write", full)
    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(3, seed=5))
    before = set(tmp_path.iterdir())
    capsys.readouterr()
    assert main(["encode", str(src), "-o", str(tmp_path / out), *OPTS]) == 2
    err = capsys.readouterr().err
    assert err == f"dice-fast: error: cannot write {tmp_path / out}: No space left on device; no output written\n", err
    assert set(tmp_path.iterdir()) == before  # no temporary file, no folder left behind


def test_a_full_disk_midway_says_what_is_committed_and_how_to_go_on(tmp_path, capsys, monkeypatch, cached_encoders):
    """A folder job stopped by a full disk named only the folder; now, as after an interrupt, what its
    committed shards hold and --resume, and an --overwrite that fails says the previous output stays."""
    import dice_fast.corpus.outputs as outputs

    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(10, seed=5))
    real, calls = outputs._ParquetStream.write, []

    def full_at_the_third(self, *args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kw)

    monkeypatch.setattr(outputs._ParquetStream, "write", full_at_the_third)
    capsys.readouterr()
    assert main(["encode", str(src), "-o", str(tmp_path / "s"), "--shard-rows", "4", *OPTS]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dice-fast: error: cannot write {tmp_path / 's'}: No space left on device; ") and \
        "8 rows in 2 shards are committed" in err and "continue with --resume" in err, err
    monkeypatch.setattr(outputs._ParquetStream, "write", real)
    assert main(["encode", str(src), "-o", str(tmp_path / "v.parquet"), *OPTS]) == 0
    calls[:] = [1, 1]  # the next write fails
    monkeypatch.setattr(outputs._ParquetStream, "write", full_at_the_third)
    capsys.readouterr()
    assert main(["encode", str(src), "-o", str(tmp_path / "v.parquet"), "--overwrite", *OPTS]) == 2
    assert "still holds the previous output" in capsys.readouterr().err


def test_a_flipped_byte_in_a_vector_is_refused_naming_the_file(tmp_path, cached_encoders):
    """Same size, one byte changed inside the vectors: a shard fails the sha256 its manifest recorded,
    a single .parquet its page checksum (both read back a wrong vector before, with no error); the
    index reads shards through the same check."""
    import pyarrow.parquet as pq

    from dice_fast.errors import InputError
    from dice_fast.index import DiceIndex

    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(6, seed=5))
    for out in ("shards", "v.parquet"):
        assert main(["encode", str(src), "-o", str(tmp_path / out), "--shard-rows", "4", "--chunks", *OPTS]) == 0
    for name, said in (("shards/part-00000.parquet", "damaged (its sha256 is not the"),
                       ("v.parquet", "not a readable Parquet file, damaged or truncated (could not verify page")):
        f = tmp_path / name
        data = bytearray(f.read_bytes())
        meta = pq.ParquetFile(f).metadata.row_group(0).column(1)  # the embedding column's pages
        at = (meta.dictionary_page_offset or meta.data_page_offset) + meta.total_compressed_size // 2
        data[at] ^= 0x40
        f.write_bytes(bytes(data))
        with pytest.raises(InputError, match=re.escape(f"{f}: {said}")):
            load_embeddings(tmp_path / name.split("/")[0])
    with pytest.raises(InputError, match=re.escape(f"{tmp_path / 'shards' / 'part-00000.parquet'}: damaged")):
        DiceIndex.from_corpus(tmp_path / "shards")


def test_damaged_outputs_are_refused_naming_the_file(tmp_path, capsys, cached_encoders):
    """A truncated shard, .npy or single Parquet file, and a manifest without a key its readers need,
    give an InputError naming the file (and key), and one line from the command line."""
    from dice_fast.errors import InputError

    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(6, seed=5))
    for out in ("shards", "v.npy", "v.parquet"):
        assert main(["encode", str(src), "-o", str(tmp_path / out), "--shard-rows", "4", *OPTS]) == 0
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    for name in ("shards/part-00001.parquet", "v.npy", "v.parquet"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(data[: len(data) // 2])
        if name == "v.npy":  # the ids file records the vectors' sha256: record the cut file's
            ids = (tmp_path / "v.ids.txt").read_text().split("\n")
            cut = hashlib.sha256(data[: len(data) // 2]).hexdigest()
            ids[0] = ids[0].split("vectors_sha256=")[0] + "vectors_sha256=" + cut
            (tmp_path / "v.ids.txt").write_text("\n".join(ids))
        said = f"{len(data) // 2} bytes, not the {len(data)} recorded" if name.startswith("shards") else "not a readable"
        with pytest.raises(InputError, match=re.escape(f"{tmp_path / name}: {said}")):
            load_embeddings(tmp_path / name.split("/")[0])
    (tmp_path / "shards" / "part-00001.parquet").unlink()
    with pytest.raises(FileNotFoundError, match=r"part-00001\.parquet: missing \(its manifest lists it\)"):
        load_embeddings(tmp_path / "shards")  # a MissingFile: an InputError and a FileNotFoundError
    with pytest.raises(InputError, match=r"part-00001\.parquet: missing \(its manifest lists it\)"):
        load_embeddings(tmp_path / "shards")
    path = tmp_path / "shards" / "manifest.json"
    for damaged, message in [({k: v for k, v in manifest.items() if k != "status"}, "no key 'status'"),
                             ({**manifest, "split": {"index": 0}}, "no key 'split.count'"),
                             ({**manifest, "model": {"dim": "384"}}, "model.dim is str, expected int"),
                             ({**manifest, "shards": [{**manifest["shards"][0], "rows": None}]},
                              "shards[0].rows is NoneType, expected int"),
                             ({**manifest, "shards": [{**manifest["shards"][0], "file": "../c.jsonl"}]},
                              "shards[0].file '../c.jsonl' is not a file name")]:
        path.write_text(json.dumps(damaged), encoding="utf-8")
        with pytest.raises(InputError, match=re.escape(f"{path}: damaged manifest: {message}")):
            load_embeddings(tmp_path / "shards")
    capsys.readouterr()
    assert main(["index", str(tmp_path / "shards"), "-o", str(tmp_path / "ix")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: damaged manifest" in err, err


def test_every_parquet_reader_says_the_same_for_a_file_that_is_not_parquet(tmp_path, capsys):
    """One wording, one set of errors caught (`reading_parquet`) wherever a Parquet file is read: encode's
    input, ``load_embeddings``, ``index`` and ``push`` (pyarrow's errors that are no ValueError or
    OSError too); a missing file is a `MissingFile`, a bug or running out of memory passes through."""
    import pyarrow as pa

    from dice_fast.corpus.readers import read_documents
    from dice_fast.errors import InputError, MissingFile, reading_parquet

    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 not really")
    said = f"{junk}: not a readable Parquet file, damaged or truncated ("
    with pytest.raises(InputError, match=re.escape(said)):
        read_documents(str(junk))
    with pytest.raises(InputError, match=re.escape(said)):
        load_embeddings(junk)
    for command in (["index", str(junk), "-o", str(tmp_path / "ix")],
                    ["index", "push", str(junk), "--to", f"lancedb://{tmp_path / 'db'}#t"]):
        assert main(command) != 0
        assert said in capsys.readouterr().err, command
    for raised, caught in ((pa.ArrowCapacityError("too big"), InputError), (FileNotFoundError(2, "gone"), MissingFile),
                           (KeyError("id"), InputError), (MemoryError(), MemoryError), (AttributeError("bug"), AttributeError)):
        with pytest.raises(caught) as info, reading_parquet(junk):
            raise raised
        assert isinstance(info.value, InputError) == (caught in (InputError, MissingFile)), raised


def test_a_dangling_link_in_the_outputs_place_is_replaced_only_with_overwrite(tmp_path, capsys, cached_encoders):
    """`-o gone.npy`, a link to nothing, was replaced without --overwrite (exists() is False for it)."""
    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(2, seed=5))
    link = tmp_path / "gone.npy"
    link.symlink_to(tmp_path / "nowhere.npy")
    capsys.readouterr()
    assert main(["encode", str(src), "-o", str(link), *OPTS]) == 2
    assert f"{link} exists (a link to nothing); pass --overwrite" in capsys.readouterr().err
    assert link.is_symlink()
    assert main(["encode", str(src), "-o", str(link), "--overwrite", *OPTS]) == 0
    assert not link.is_symlink() and load_embeddings(link)[1].shape[0] == 2
