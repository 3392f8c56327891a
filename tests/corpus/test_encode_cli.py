"""The command line: input formats, malformed input by line number, no partial output."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dice_fast import DiceEncoder
from dice_fast.cli import main, read_documents
from helpers import assert_close


def test_read_txt_and_jsonl(tmp_path):
    txt = tmp_path / "d.txt"
    txt.write_text("first doc\n\nthird doc\r\n", encoding="utf-8")
    assert read_documents(str(txt)) == ["first doc", "", "third doc"]
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "a"}\n\n{"body": "b", "text": "c"}\n', encoding="utf-8")
    assert read_documents(str(jl)) == ["a", "c"]


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"text": "ok"}\n{"text": oops}\n', r"d\.jsonl:2: malformed JSON"),
        ('{"text": "ok"}\n[1, 2]\n', r"d\.jsonl:2: expected a JSON object, got list"),
        ('{"text": "ok"}\n{"title": "x"}\n', r"d\.jsonl:2: no field 'text' \(fields: title\)"),
        ('{"text": 5}\n', r"d\.jsonl:1: field 'text' is int"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, content, match):
    p = tmp_path / "d.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        read_documents(str(p))


def test_bad_utf8_names_the_line(tmp_path):
    p = tmp_path / "d.txt"
    p.write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(ValueError, match=r"d\.txt:2: not valid UTF-8"):
        read_documents(str(p))


def test_encode_writes_rows_in_order_and_summary(tmp_path, capsys):
    docs = ["alpha beta gamma " * 40, "", "short one", "delta " * 300]
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)) + "\n", encoding="utf-8")
    out = tmp_path / "sub" / "vecs.npy"
    rc = main(["encode", str(src), "--output", str(out), "--field", "body", "--chunk-size", "32",
               "--block-documents", "3", "--aggregation", "max", "--quiet"])
    assert rc == 0
    got = np.load(out)
    enc = DiceEncoder.from_pretrained(chunk_size=32, aggregation="max")
    assert_close(got, enc.encode_documents(docs), 1e-5, what="CLI rows")
    summary = capsys.readouterr().out
    assert "encoded 4 documents" in summary and "tokens/s" in summary
    assert [p.name for p in out.parent.iterdir()] == ["vecs.npy"]  # no temporary left behind


def test_malformed_input_writes_no_output(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"\n', encoding="utf-8")
    out = tmp_path / "out.npy"
    assert main(["encode", str(src), "--output", str(out), "--quiet"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


def test_bad_option_is_reported_without_output(tmp_path, capsys):
    src = tmp_path / "d.txt"
    src.write_text("x\n", encoding="utf-8")
    out = tmp_path / "o.npy"
    assert main(["encode", str(src), "-o", str(out), "--chunk-size", "8", "--overlap", "8"]) == 2
    assert "overlap (8) must be smaller than chunk_size (8)" in capsys.readouterr().err
    assert not out.exists()


def test_help_documents_every_option():
    text = subprocess.run([sys.executable, "-m", "dice_fast.cli", "encode", "--help"], capture_output=True,
                          text=True, check=True).stdout
    for flag in ("--chunk-size", "--overlap", "--positions", "--pooling", "--aggregation", "--top-k", "--temperature",
                 "--normalize-chunks", "--no-normalize", "--strategy", "--attention", "--attention-backend",
                 "--document-prefix", "--max-chunks-per-document", "--max-batch-tokens", "--device", "--dtype",
                 "--model", "--field", "--format"):
        assert flag in text
