"""`runinfo.append_csv`: benchmark and evaluation rows appended to CSVs kept across sessions."""

from __future__ import annotations

import csv

import pytest

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


def test_cpu_model_names_family_and_model(tmp_path):
    """A virtual machine's "AMD EPYC" names no generation; family and model numbers tell Zen 3/4/5 apart."""
    info = tmp_path / "cpuinfo"
    block = "processor\t: {}\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\n"
    info.write_text(block.format(0) + block.format(1).replace("26", "25"), encoding="utf-8")
    assert cpu_model(str(info)) == "AMD EPYC, family 26 model 2"  # the first processor's block only
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\n", encoding="utf-8")
    assert cpu_model(str(info)) == "Some CPU"
    assert cpu_model(str(tmp_path / "missing"))  # falls back to what platform says
