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
    pq.write_table(pa.table({"text": pa.array(["a b", "c d"], pa.string_view()),
                             "id": pa.array(["x", "y"], pa.string_view())}), p)
    assert list(open_corpus(str(p), id_field="id").records()) == [("x", "a b"), ("y", "c d")]
