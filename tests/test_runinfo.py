"""`runinfo.append_csv`: benchmark and evaluation rows appended to CSVs kept across sessions."""

from __future__ import annotations

import csv

from dice_fast.runinfo import append_csv


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
