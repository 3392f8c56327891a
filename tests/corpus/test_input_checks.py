"""Input checks of ``dice-fast encode`` that name the culprit when the input is opened or its line read:
lone surrogates in JSON lines, JSON nested too deeply, Parquet id columns of other types, and
categorical (dictionary-encoded) Parquet columns."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dice_fast.corpus.readers import open_corpus
from dice_fast.errors import InputError


@pytest.mark.parametrize("line,match", [
    ('{"text": "a \\ud800 b"}', r"d\.jsonl:2: field 'text' is not valid Unicode: a lone surrogate \(\\ud800\)"),
    ('{"text": "ok", "id": "x\\udc00"}', r"d\.jsonl:2: id field 'id' is not valid Unicode: a lone surrogate"),
])
def test_a_lone_surrogate_names_the_line_when_read(tmp_path, line, match):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "fine \\u00e9", "id": "\\ud83d\\ude00"}\n' + line + "\n", encoding="utf-8")
    records = open_corpus(str(p), id_field="id" if '"id"' in line else None).records()
    assert next(records)[1] == "fine \u00e9"  # escapes of valid characters, a surrogate pair among them, pass
    with pytest.raises(InputError, match=match):
        next(records)


def test_a_byte_order_mark_starting_a_file_is_no_text(tmp_path):
    """Windows editors start UTF-8 files with a byte order mark: JSON Lines were refused at line 1, a
    text file's first document began with an invisible U+FEFF (another vector). Only line 1 loses it."""
    from dice_fast.textio import read_json_objects

    bom = b"\xef\xbb\xbf"
    (tmp_path / "d.jsonl").write_bytes(bom + b'{"text": "hello"}\r\n' + b'{"text": "x\xef\xbb\xbf"}\n')
    (tmp_path / "d.txt").write_bytes(bom + b"hello\r\n")
    assert [t for _, t in open_corpus(str(tmp_path / "d.jsonl")).records()] == ["hello", "x\ufeff"]
    assert [t for _, t in open_corpus(str(tmp_path / "d.txt")).records()] == ["hello"]
    assert [r["text"] for _, r in read_json_objects(tmp_path / "d.jsonl")] == ["hello", "x\ufeff"]


def test_json_nested_too_deeply_names_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n' + "[" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"d\.jsonl:2: malformed JSON \(nested too deeply\)"):
        list(open_corpus(str(p)).records())


@pytest.mark.parametrize("ids,kind", [([[1], [2]], "list<element: int64>"), ([{"x": 1}, {"x": 2}], "struct<x: int64>"),
                                      ([1.5, 2.0], "double"), ([True, False], "bool")])
def test_parquet_id_column_of_another_type_is_refused_when_opened(tmp_path, ids, kind):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "_id": ids}), p)
    with pytest.raises(InputError, match=rf"d\.parquet: id column '_id' is {kind}, expected strings or integers"):
        open_corpus(str(p), id_field="_id")


def test_parquet_ids_of_strings_integers_bytes_and_dictionaries(tmp_path):
    for ids, expected in [([7, 8], ["7", "8"]), ([b"x", b"y"], ["x", "y"]),
                          (pa.array(["x", "y"]).dictionary_encode(), ["x", "y"])]:
        pq.write_table(pa.table({"text": ["a", "b"], "_id": ids}), tmp_path / "d.parquet")
        assert [i for i, _ in open_corpus(str(tmp_path / "d.parquet"), id_field="_id").records()] == expected
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"], "_id": [b"ok", b"fine", b"\xff"]}), p, row_group_size=2)
    with pytest.raises(InputError, match=r"bad\.parquet: row 3: id column '_id' is not valid UTF-8"):
        list(open_corpus(str(p), id_field="_id").records())


def test_categorical_parquet_text_column_is_read_as_strings(tmp_path):
    p = tmp_path / "d.parquet"
    cats = pa.array(["a b", "c d", "a b"]).dictionary_encode()
    pq.write_table(pa.table({"cat": cats, "large": cats.cast(pa.dictionary(pa.int8(), pa.large_string()))}), p,
                   row_group_size=2)
    assert list(open_corpus(str(p), text_field="cat").records()) == [("1", "a b"), ("2", "c d"), ("3", "a b")]
    assert [t for _, t in open_corpus(str(p), text_field="large").records()] == ["a b", "c d", "a b"]


def test_string_view_parquet_columns_are_read_as_strings(tmp_path):
    p = tmp_path / "v.parquet"  # pyarrow and polars write string_view columns
    try:
        pq.write_table(pa.table({"text": pa.array(["a b", "c d"], pa.string_view()),
                                 "id": pa.array(["x", "y"], pa.string_view())}), p)
    except pa.ArrowNotImplementedError:  # pyarrow 16-18 read string_view from Parquet but cannot write it
        pytest.skip(f"pyarrow {pa.__version__} cannot write string_view columns to Parquet")
    assert list(open_corpus(str(p), id_field="id").records()) == [("x", "a b"), ("y", "c d")]


# ---------------------------------------------------------------------------------------------
# bad input that the libraries underneath report without a place: each error names the file and line/row


def test_a_json_integer_too_long_to_convert_names_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "fine"}\n{"text": "a", "n": ' + "1" * 5000 + "}\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"d\.jsonl:2: unreadable JSON \(Exceeds the limit \(4300( digits)?\)"):
        list(open_corpus(str(p)).records())


def _invalid_utf8(values):  # a string column holding bytes that are not UTF-8, as other writers may leave
    return pa.array(values, pa.binary()).view(pa.string())


@pytest.mark.parametrize("column,what", [("text", "column 'text'"), ("id", "id column 'id'")])
def test_parquet_strings_that_are_not_utf8_name_the_row(tmp_path, column, what):
    p = tmp_path / "d.parquet"
    cols = {"text": pa.array(["a", "b", "c"]), "id": pa.array(["x", "y", "z"])}
    cols[column] = _invalid_utf8([b"ok", b"fine", b"\xff\xfe bad"])
    pq.write_table(pa.table(cols), p, row_group_size=2)
    with pytest.raises(InputError, match=rf"d\.parquet: row 3: {what} is not valid UTF-8"):
        list(open_corpus(str(p), id_field="id").records())


def test_a_damaged_parquet_page_names_the_file_and_its_row_group(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"document number {i} " * 5 for i in range(5000)]}), p,
                   compression="snappy", row_group_size=1000)
    meta = pq.ParquetFile(p).metadata
    start = meta.row_group(3).column(0).data_page_offset  # the footer stays intact: the file opens
    raw = bytearray(p.read_bytes())
    for i in range(start + 40, start + 400):
        raw[i] ^= 0x5A
    p.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"d\.parquet: row 3001: cannot read row group 3 \(rows 3001-4000\), "
                       r"the file is damaged \(.+\)"):
        list(open_corpus(str(p)).records())


def test_damaged_input_stops_the_cli_with_one_line(tmp_path, capsys, cached_encoders):
    from dice_fast.cli import main

    src = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": _invalid_utf8([b"ok", b"\xff"])}), src)
    assert main(["encode", str(src), "-o", str(tmp_path / "o.npy"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src}: row 2: column 'text' is not valid UTF-8" in err, err
    assert not (tmp_path / "o.npy").exists()


def test_a_parquet_id_column_that_is_the_text_column(tmp_path):
    """--id-field equal to --field asked Parquet for the column twice and got it once: IndexError."""
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "d.parquet")
    assert list(open_corpus(str(tmp_path / "d.parquet"), id_field="text").records()) == [("a", "a"), ("b", "b")]


def test_a_parquet_with_two_columns_of_one_name_is_refused_when_opened(tmp_path):
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"])
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(InputError, match=r"d\.parquet: 2 columns are named 'text'"):
        open_corpus(str(tmp_path / "d.parquet"))


def test_id_field_on_a_text_file_is_refused_not_made_up(tmp_path):
    """A .txt line has no fields: its id was FILE:LINE whatever --id-field said (docs: never an invented id)."""
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "a.jsonl").write_text('{"text": "x", "_id": "d1"}\n', encoding="utf-8")
    (tmp_path / "f" / "b.txt").write_text("y\n", encoding="utf-8")
    for source in (tmp_path / "f", tmp_path / "f" / "b.txt"):
        with pytest.raises(InputError, match=r"b\.txt is a \.txt file .* --id-field '_id' cannot apply"):
            open_corpus(str(source), id_field="_id")
    with pytest.raises(InputError, match="stdin read as .txt"):
        open_corpus("-", fmt="txt", id_field="_id")
    assert [i for i, _ in open_corpus(str(tmp_path / "f")).records()] == ["a.jsonl:1", "b.txt:1"]


def test_folder_entries_that_cannot_be_read_are_named(tmp_path):
    """A file name that is not UTF-8 failed at the very end (ids are UTF-8), naming no file; a broken
    link read as "not readable"; a subfolder that cannot be listed lost its documents silently."""
    import os

    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "a.txt").write_text("x\n", encoding="utf-8")
    bad = os.path.join(os.fsencode(tmp_path / "f"), b"n\xff.txt")
    with open(bad, "wb") as fh:
        fh.write(b"y\n")
    with pytest.raises(InputError, match=r"its file name is not valid UTF-8"):
        open_corpus(str(tmp_path / "f"))
    os.unlink(bad)
    (tmp_path / "f" / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(FileNotFoundError, match=r"gone\.txt is a broken symbolic link"):
        open_corpus(str(tmp_path / "f"))
    (tmp_path / "f" / "gone.txt").unlink()
    (tmp_path / "f" / "locked").mkdir()
    real = os.scandir

    def refused(path="."):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    import unittest.mock

    with unittest.mock.patch.object(os, "scandir", refused):
        with pytest.raises(InputError, match=r"input folder .*locked cannot be read \(Permission denied\)"):
            open_corpus(str(tmp_path / "f"))


def test_a_broken_link_given_as_the_input_is_named_as_one(tmp_path):
    (tmp_path / "in.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(FileNotFoundError, match=r"in\.txt does not exist \(a broken symbolic link to .*gone\.txt\)"):
        open_corpus(str(tmp_path / "in.txt"))


def test_compressed_line_files_read_as_the_plain_ones(tmp_path, cached_encoders):
    """A corpus of .jsonl.gz (how MS MARCO or C4 ship) was "unknown input type '.gz'": it is read
    decompressed as a stream, alone or in a folder (ids carry its name), its progress counted in its
    compressed bytes, and encoded to the plain file's vectors; `read_lines` (the index and eval inputs)
    reads it too. A damaged or cut-short one names the file and the line after which it breaks."""
    import bz2
    import gzip
    import json
    import lzma

    import numpy as np

    from dice_fast import DiceIndex
    from dice_fast.cli import main
    from dice_fast.corpus import load_embeddings
    from dice_fast.textio import read_lines

    lines = [json.dumps({"id": f"d{i}", "text": f"document {i} " + "word " * (i * 7)}) for i in range(10)]
    data = ("\n".join(lines) + "\n").encode()
    (tmp_path / "plain.jsonl").write_bytes(data)
    folder = tmp_path / "in"
    folder.mkdir()
    for name, pack in (("a.jsonl.gz", gzip.compress), ("b.ndjson.bz2", bz2.compress), ("c.jsonl.xz", lzma.compress),
                       ("d.txt.gz", gzip.compress)):
        (folder / name).write_bytes(pack(data if "json" in name else b"one line\n\nanother line\n"))
    want = list(open_corpus(str(tmp_path / "plain.jsonl"), id_field="id").records())
    for name in ("a.jsonl.gz", "b.ndjson.bz2", "c.jsonl.xz"):
        corpus = open_corpus(str(folder / name), id_field="id")
        assert list(corpus.records()) == want and corpus.bytes_read == corpus.total_bytes == (folder / name).stat().st_size
    every = list(open_corpus(str(folder)).records())
    assert [i for i, _ in every[-2:]] == ["d.txt.gz:1", "d.txt.gz:3"] and every[0] == ("a.jsonl.gz:1", want[0][1])
    assert [line for _, line in read_lines(folder / "d.txt.gz")] == ["one line", "", "another line"]
    for src in ("plain.jsonl", "in/a.jsonl.gz"):
        assert main(["encode", str(tmp_path / src), "--id-field", "id", "-o", str(tmp_path / f"{src[:2]}.npy"), "-q"]) == 0
    (ids, a), (ids_gz, b) = load_embeddings(tmp_path / "pl.npy"), load_embeddings(tmp_path / "in.npy")
    assert ids == ids_gz and np.array_equal(a, b)
    assert main(["index", str(folder / "c.jsonl.xz"), "--id-field", "id", "-o", str(tmp_path / "ix")]) == 0
    assert DiceIndex.load(tmp_path / "ix").ids == [i for i, _ in want]
    packed = gzip.compress(data)
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) * 2 // 3])
    with pytest.raises(InputError, match=r"cut.jsonl.gz: after line \d+: its gzip data is damaged or cut short"):
        list(open_corpus(str(tmp_path / "cut.jsonl.gz")).records())
    (tmp_path / "t.parquet.gz").write_bytes(b"")
    with pytest.raises(InputError, match=r"unknown input type '.parquet.gz'"):
        open_corpus(str(tmp_path / "t.parquet.gz"))
