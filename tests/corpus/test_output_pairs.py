"""Ids and vectors always agree: the ``.npy`` output is committed vectors first, ids file last (the ids
file records the vectors' row count and sha256), so a job that dies between the two renames leaves a
pair that `load_embeddings` refuses by name instead of pairing new ids with old vectors; and every
reader checks counts."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from dice_fast.cli import main
from dice_fast.corpus import load_embeddings


class Died(BaseException):
    """The process dying at this point (raised like a signal would be, past every ``except Exception``)."""


def _encode(src, out, *extra):
    return main(["encode", str(src), "-o", str(out), "-q", *extra])


def _dying_at_rename(monkeypatch, n: int) -> list[str]:
    """Make the ``n``-th ``os.replace`` of the job raise `Died` (the renames before it happen)."""
    renamed: list[str] = []
    real = os.replace

    def replace(src, dst):
        renamed.append(os.path.basename(dst))
        if len(renamed) == n:
            raise Died
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return renamed


def test_a_death_between_the_two_renames_is_refused_by_name(tmp_path, monkeypatch, cached_encoders):
    old_src, new_src = tmp_path / "old.txt", tmp_path / "new.txt"
    old_src.write_text("one\ntwo\nthree\n", encoding="utf-8")
    new_src.write_text("four\nfive\n", encoding="utf-8")
    out = tmp_path / "v.npy"
    assert _encode(old_src, out) == 0
    ids, old = load_embeddings(out)
    assert ids == ["1", "2", "3"] and old.shape == (3, 384)

    renamed = _dying_at_rename(monkeypatch, 2)
    with pytest.raises(Died):
        _encode(new_src, out, "--overwrite")
    monkeypatch.undo()
    assert renamed == ["v.npy", "v.ids.txt"]  # the vectors first; the ids file, the commit point, never came
    assert np.load(out).shape == (2, 384)  # new vectors beside the old ids: exactly the state to refuse
    with pytest.raises(ValueError, match="v.ids.txt does not belong to v.npy: it was committed with a vector file "
                                         "of 3 rows and sha256 [0-9a-f]{12}[.][.][.], v.npy has sha256"):
        load_embeddings(out)
    assert _encode(new_src, out, "--overwrite") == 0
    ids, new = load_embeddings(out)
    assert ids == ["1", "2"] and new.shape == (2, 384)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.txt", "old.txt", "v.ids.txt", "v.npy"]

    # a fresh output that died between the renames: vectors without ids
    lone = tmp_path / "lone.npy"
    _dying_at_rename(monkeypatch, 2)
    with pytest.raises(Died):
        _encode(new_src, lone)
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="lone.npy has no ids file lone.ids.txt beside it"):
        load_embeddings(lone)


def test_counts_are_checked_for_hand_made_and_edited_pairs(tmp_path, cached_encoders):
    np.save(tmp_path / "hand.npy", np.zeros((3, 4), np.float32))
    (tmp_path / "hand.ids.txt").write_text("a\nb\n", encoding="utf-8")  # no record: counts only
    with pytest.raises(ValueError, match=r"hand.npy holds 3 rows \(shape \(3, 4\)\) but hand.ids.txt lists 2 ids"):
        load_embeddings(tmp_path / "hand.npy")
    (tmp_path / "hand.ids.txt").write_text("a\nb\nc\n", encoding="utf-8")
    assert load_embeddings(tmp_path / "hand.npy")[0] == ["a", "b", "c"]

    src = tmp_path / "d.txt"
    src.write_text("one\ntwo\nthree\n", encoding="utf-8")
    assert _encode(src, tmp_path / "v.npy") == 0
    ids_file = tmp_path / "v.ids.txt"
    ids_file.write_text(ids_file.read_text(encoding="utf-8") + "extra\n", encoding="utf-8")
    with pytest.raises(ValueError, match="v.ids.txt records 3 rows but lists 4 ids"):
        load_embeddings(tmp_path / "v.npy")

    # a shard replaced after commit by another one
    assert _encode(src, tmp_path / "shards", "--shard-rows", "2") == 0
    shutil.copyfile(tmp_path / "shards" / "part-00001.parquet", tmp_path / "shards" / "part-00000.parquet")
    with pytest.raises(ValueError, match=r"part-00000.parquet: \d+ bytes, not the \d+ recorded when it was committed"):
        load_embeddings(tmp_path / "shards")


def test_a_path_that_does_not_exist_is_a_missing_file(tmp_path):
    """A missing folder or .parquet read as "no manifest*.json ...", a missing index folder as "not a
    dice_fast index": both are a MissingFile (a FileNotFoundError and an InputError) naming the path."""
    from dice_fast import DiceIndex
    from dice_fast.errors import InputError, MissingFile

    for path in (tmp_path / "nope", tmp_path / "nope.parquet", tmp_path / "nope.npy"):
        with pytest.raises(MissingFile, match=str(path)) as info:
            load_embeddings(path)
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, InputError)
    with pytest.raises(MissingFile, match="nope.index does not exist"):
        DiceIndex.load(tmp_path / "nope.index")
    with pytest.raises(MissingFile, match="no such file or folder"):
        DiceIndex.from_corpus(tmp_path / "nope")
