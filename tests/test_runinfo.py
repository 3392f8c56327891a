"""`runinfo.append_csv`: benchmark and evaluation rows appended to CSVs kept across sessions."""

from __future__ import annotations

import csv
import errno
import os
import re

import pytest

from dice_fast.errors import InputError, WriteError
from dice_fast.runinfo import append_csv, cpu_model


def _read(path):
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        return next(reader), list(reader)


def test_new_file_gets_the_union_of_the_rows_keys(tmp_path):
    path = tmp_path / "sub" / "r.csv"
    assert append_csv([{"a": 1, "b": 2}, {"a": 3, "c": 4}], path) == 2
    assert _read(path) == (["a", "b", "c"], [["1", "2", ""], ["3", "", "4"]])


def test_existing_header_keeps_its_order(tmp_path):
    path = tmp_path / "r.csv"
    append_csv([{"a": 1, "b": 2}], path)
    append_csv([{"b": 20, "a": 10}], path)  # other key order: values still land under their names
    assert _read(path) == (["a", "b"], [["1", "2"], ["10", "20"]])


def test_a_new_column_widens_the_file_instead_of_shifting_values(tmp_path):
    path = tmp_path / "r.csv"
    append_csv([{"a": 1, "b": 2}], path)
    append_csv([{"a": 3, "path": "batches", "b": 4}], path)
    assert _read(path) == (["a", "b", "path"], [["1", "2", ""], ["3", "4", "batches"]])
    assert [p.name for p in tmp_path.iterdir()] == ["r.csv"]  # no temporary file left behind


def test_explicit_fieldnames_ignore_other_keys(tmp_path):
    path = tmp_path / "r.csv"
    append_csv([{"a": 1, "b": 2, "debug": "x"}], path, fieldnames=["a", "b"])
    assert _read(path) == (["a", "b"], [["1", "2"]])


def test_no_rows_writes_nothing(tmp_path):
    assert append_csv([], tmp_path / "r.csv") == 0
    assert not (tmp_path / "r.csv").exists()


def test_a_file_with_rows_wider_than_its_header_is_refused_not_rewritten(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("a,b\n1,2,EXTRA\n", encoding="utf-8")
    for row in ({"a": 3, "b": 4}, {"a": 3, "c": 5}):  # appending, and widening
        with pytest.raises(ValueError, match=r"r.csv:2: 3 values under a header of 2 columns"):
            append_csv([row], path)
    assert path.read_text(encoding="utf-8") == "a,b\n1,2,EXTRA\n"


def test_a_last_row_cut_off_is_refused_not_continued(tmp_path):
    """A write cut off by a full disk left "m2,0.5" without its line end: the next row would continue
    it ("m2,0.5m3,0.99,0.98"), its values under other columns."""
    path = tmp_path / "r.csv"
    path.write_text("model,hit1,ndcg\nm1,0.91,0.80\nm2,0.5", encoding="utf-8")
    with pytest.raises(InputError, match=r"r.csv: its last line has no line end"):
        append_csv([{"model": "m3", "hit1": 0.99, "ndcg": 0.98}], path)
    assert path.read_text(encoding="utf-8") == "model,hit1,ndcg\nm1,0.91,0.80\nm2,0.5"


def test_an_append_that_fills_the_disk_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "r.csv"
    append_csv([{"model": "m1", "hit1": 0.91}], path)
    before = path.read_bytes()
    real = os.write

    def half_then_full(fd, data):
        if len(data) > 1:
            return real(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(WriteError, match=f"cannot write {re.escape(str(path))}: No space left on device"):
        append_csv([{"model": "m2", "hit1": 0.5}, {"model": "m3", "hit1": 0.7}], path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    append_csv([{"model": "m4", "hit1": 0.6}], path)
    assert list(csv.DictReader(path.open())) == [{"model": "m1", "hit1": "0.91"}, {"model": "m4", "hit1": "0.6"}]


def test_cpu_model_names_family_and_model(tmp_path):
    """A virtual machine's "AMD EPYC" names no generation; family and model numbers tell Zen 3/4/5 apart."""
    info = tmp_path / "cpuinfo"
    block = "processor\t: {}\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\n"
    info.write_text(block.format(0) + block.format(1).replace("26", "25"), encoding="utf-8")
    assert cpu_model(str(info)) == "AMD EPYC, family 26 model 2"  # the first processor's block only
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\n", encoding="utf-8")
    assert cpu_model(str(info)) == "Some CPU"
    assert cpu_model(str(tmp_path / "missing"))  # falls back to what platform says
