"""``dice-fast encode``: input formats and ids, outputs, queries, stdin, and one-line errors without output."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from corpus_util import corpus_docs, encoder, write_jsonl
from dice_fast.cli import main
from dice_fast.corpus import load_embeddings
from dice_fast.corpus.readers import open_corpus, read_documents
from dice_fast.matryoshka import truncate
from helpers import assert_close


# ---------------------------------------------------------------------------------------------
# reading


def test_blank_lines_are_skipped_alike_and_ids_are_line_numbers(tmp_path):
    txt = tmp_path / "d.txt"
    txt.write_text("first doc\n\n   \nfourth doc\r\n", encoding="utf-8")
    c = open_corpus(str(txt))
    assert list(c.records()) == [("1", "first doc"), ("4", "fourth doc")] and c.blank_lines == 2
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "a"}\n\n \n{"body": "b", "text": ""}\n', encoding="utf-8")
    c = open_corpus(str(jl))
    assert list(c.records()) == [("1", "a"), ("4", "")] and c.blank_lines == 2  # "" in a field is a document
    assert read_documents(str(txt)) == ["first doc", "fourth doc"]


def test_jsonl_id_field(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"_id": "x1", "text": "a"}\n{"_id": 7, "text": "b"}\n', encoding="utf-8")
    assert list(open_corpus(str(jl), id_field="_id").records()) == [("x1", "a"), ("7", "b")]


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


@pytest.mark.parametrize("line,match", [('{"text": "a"}', r"d\.jsonl:1: no id field 'id'"),
                                        ('{"text": "a", "id": 1.5}', r"d\.jsonl:1: id 1\.5 is float"),
                                        ('{"text": "a", "id": "x\\ny"}', r"d\.jsonl:1: id .* contains a line break")])
def test_bad_ids_name_the_line(tmp_path, line, match):
    p = tmp_path / "d.jsonl"
    p.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        list(open_corpus(str(p), id_field="id").records())


def test_bad_utf8_names_the_line(tmp_path):
    p = tmp_path / "d.txt"
    p.write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(ValueError, match=r"d\.txt:2: not valid UTF-8"):
        read_documents(str(p))


def test_parquet_input(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"key": [10, 20, 30], "body": ["a", "", "c"]}), p, row_group_size=2)
    assert list(open_corpus(str(p), text_field="body").records()) == [("1", "a"), ("2", ""), ("3", "c")]
    assert list(open_corpus(str(p), text_field="body", id_field="key").records()) == [("10", "a"), ("20", ""),
                                                                                     ("30", "c")]
    with pytest.raises(ValueError, match=r"d\.parquet: no text column 'text' \(columns: key, body\)"):
        open_corpus(str(p))
    with pytest.raises(ValueError, match=r"column 'key' is int64, expected strings"):
        open_corpus(str(p), text_field="key")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n\.parquet: row 2: column 'text' is null"):
        list(open_corpus(str(tmp_path / "n.parquet")).records())


def test_folder_input_is_sorted_recursive_and_ids_carry_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("b1\nb2\n", encoding="utf-8")
    (tmp_path / "sub" / "a.jsonl").write_text('{"text": "a1"}\n', encoding="utf-8")
    (tmp_path / "a.txt").write_text("a\n\nc\n", encoding="utf-8")
    (tmp_path / ".hidden.txt").write_text("no\n", encoding="utf-8")
    (tmp_path / "notes.md").write_text("no\n", encoding="utf-8")
    c = open_corpus(str(tmp_path))
    assert list(c.records()) == [("a.txt:1", "a"), ("a.txt:3", "c"), ("b.txt:1", "b1"), ("b.txt:2", "b2"),
                                 ("sub/a.jsonl:1", "a1")]
    assert [f["name"] for f in c.fingerprint()["files"]] == ["a.txt", "b.txt", "sub/a.jsonl"]
    assert list(open_corpus(str(tmp_path), fmt="jsonl").records()) == [("sub/a.jsonl:1", "a1")]


# ---------------------------------------------------------------------------------------------
# outputs


def test_npy_output_rows_ids_and_summary(tmp_path, capsys, cached_encoders):
    docs = ["alpha beta gamma " * 40, "", "short one", "delta " * 300]
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"id": f"k{i}", "body": d}) for i, d in enumerate(docs)) + "\n\n",
                   encoding="utf-8")
    out = tmp_path / "sub" / "vecs.npy"
    rc = main(["encode", str(src), "--output", str(out), "--field", "body", "--id-field", "id", "--chunk-size", "32",
               "--aggregation", "max", "--quiet"])
    assert rc == 0
    got = np.load(out)
    assert_close(got, encoder(chunk_size=32, aggregation="max").encode_documents(docs), 1e-5, what="CLI rows")
    record, *ids = (tmp_path / "sub" / "vecs.ids.txt").read_text(encoding="utf-8").split("\n")
    assert ids == ["k0", "k1", "k2", "k3", ""]
    assert record.rstrip() == f"#dice_fast-ids rows=4 vectors_sha256={hashlib.sha256(out.read_bytes()).hexdigest()}"
    summary = capsys.readouterr().out
    assert "encoded 4 documents" in summary and "tokens/s" in summary and "skipped 1 blank line" in summary
    assert sorted(p.name for p in out.parent.iterdir()) == ["vecs.ids.txt", "vecs.npy"]  # no temporary left


def test_parquet_file_and_folder_outputs_match_npy(tmp_path, cached_encoders):
    docs = corpus_docs(23, seed=3)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    common = ["--id-field", "id", "--chunk-size", "16", "-q"]
    assert main(["encode", str(src), "-o", str(tmp_path / "v.npy"), *common]) == 0
    assert main(["encode", str(src), "-o", str(tmp_path / "v.parquet"), *common]) == 0
    assert main(["encode", str(src), "-o", str(tmp_path / "shards") + "/", "--shard-rows", "10", *common]) == 0
    ids, ref = load_embeddings(tmp_path / "v.npy")
    assert ids == [f"doc{i:04d}" for i in range(23)]
    for other in ("v.parquet", "shards"):
        ids2, vecs = load_embeddings(tmp_path / other)
        assert ids2 == ids
        np.testing.assert_array_equal(vecs, ref)
    shards = tmp_path / "shards"
    assert sorted(p.name for p in shards.iterdir()) == ["manifest.json", "part-00000.parquet", "part-00001.parquet",
                                                        "part-00002.parquet"]
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["status"] == "complete" and [s["rows"] for s in manifest["shards"]] == [10, 10, 3]
    assert manifest["config"]["chunk_size"] == 16 and manifest["model"]["dim"] == 384
    assert manifest["shards"][1]["first_id"] == "doc0010" and manifest["shards"][1]["last_id"] == "doc0019"
    table = pq.read_table(shards / "part-00001.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    meta = json.loads(table.schema.metadata[b"dice_fast"])
    assert meta["config"]["chunk_size"] == 16 and meta["shard"] == 1 and meta["dice_fast"]
    meta = json.loads(pq.read_schema(tmp_path / "v.parquet").metadata[b"dice_fast"])
    assert meta["options"]["chunk_size"] == 16 and meta["input"]["id_field"] == "id"


def test_truncate_dim_flag_writes_the_first_components_renormalised(tmp_path, cached_encoders):
    docs = corpus_docs(3, seed=4, words=(20, 300))
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    assert main(["encode", str(src), "-o", str(tmp_path / "shards") + "/", "--truncate-dim", "64", "-q"]) == 0
    ids, got = load_embeddings(tmp_path / "shards")
    assert got.shape == (3, 64)
    assert_close(got, truncate(encoder().encode_documents(docs), 64, normalize=True), 1e-5, what="--truncate-dim")
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["config"]["truncate_dim"] == 64 and manifest["model"]["dim"] == 64


def test_stdin_and_queries(tmp_path, monkeypatch, capsys, cached_encoders):
    queries = ["what is alpha river", "", "  ", "where is the " + "stone " * 400]  # the last is cut to the window
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(queries).encode() + b"\n")))
    out = tmp_path / "q.npy"
    assert main(["encode", "-", "--format", "txt", "--queries", "-o", str(out), "-q"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("dice-fast: warning: ") and "were cut" in err[0]
    ids, got = load_embeddings(out)
    assert ids == ["1", "4"]
    with pytest.warns(UserWarning):
        want = encoder().encode_queries([queries[0], queries[3]])
    assert_close(got, want, 1e-5, what="queries")


def test_queries_cut_to_the_window_are_named_once_per_job_by_id(tmp_path, capsys, cached_encoders):
    """Per block of 256 queries, numbered within it: row 301 was named "queries[44]", once per block."""
    texts = ["where is the " + "stone " * 400 if i in (5, 300, 301) else f"query {i}" for i in range(600)]
    src = write_jsonl(tmp_path / "q.jsonl", texts, [f"q{i}" for i in range(600)])
    assert main(["encode", str(src), "--queries", "--id-field", "id", "-o", str(tmp_path / "q.npy"), "-q"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("dice-fast: warning: 3 queries longer than the model window ("), err
    assert err[0].endswith("tokens: id 'q5' (403 tokens), id 'q300' (403 tokens), id 'q301' (403 tokens)"), err


def test_stdin_needs_a_format(tmp_path, capsys):
    assert main(["encode", "-", "-o", str(tmp_path / "o.npy")]) == 2
    assert "reading stdin (-) needs --format txt or --format jsonl" in capsys.readouterr().err


def test_existing_output_is_refused_unless_overwrite(tmp_path, capsys, cached_encoders):
    src = tmp_path / "d.txt"
    src.write_text("one\ntwo\n", encoding="utf-8")
    out = tmp_path / "o.npy"
    out.write_bytes(b"old")
    assert main(["encode", str(src), "-o", str(out), "-q"]) == 2
    assert f"{out} exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert out.read_bytes() == b"old"
    assert main(["encode", str(src), "-o", str(out), "-q", "--overwrite"]) == 0
    assert np.load(out).shape == (2, 384)
    folder = tmp_path / "shards"
    assert main(["encode", str(src), "-o", str(folder), "-q"]) == 0
    assert main(["encode", str(src), "-o", str(folder), "-q"]) == 2
    assert "pass --resume to continue it or --overwrite to replace it" in capsys.readouterr().err
    assert main(["encode", str(src), "-o", str(folder), "-q", "--overwrite"]) == 0


# ---------------------------------------------------------------------------------------------
# mistakes: one line on stderr, exit status 2, no output


def _fails(tmp_path, capsys, argv, message, src=None):
    if src is None:
        src = tmp_path / "d.txt"
        src.write_text("x\n", encoding="utf-8")
    before = set(tmp_path.rglob("*"))
    assert main(["encode", str(src), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dice-fast: error: "), err
    assert message in err, err
    assert set(tmp_path.rglob("*")) == before  # nothing written, no folder left behind
    return err


def test_unknown_input_type_lists_the_known_ones(tmp_path, capsys):
    src = tmp_path / "d.csv"
    src.write_text("a,b\n", encoding="utf-8")
    _fails(tmp_path, capsys, ["-o", str(tmp_path / "new" / "o.npy")], "unknown input type '.csv'; known input types: "
           ".txt", src=src)


def test_missing_input_and_empty_folder(tmp_path, capsys):
    _fails(tmp_path, capsys, ["-o", str(tmp_path / "o.npy")], "does not exist", src=tmp_path / "nope.txt")
    (tmp_path / "empty").mkdir()
    _fails(tmp_path, capsys, ["-o", str(tmp_path / "o.npy")], "holds no", src=tmp_path / "empty")


def test_malformed_input_writes_no_output(tmp_path, capsys, cached_encoders):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"\n', encoding="utf-8")
    _fails(tmp_path, capsys, ["--output", str(tmp_path / "out" / "o.npy"), "--quiet"], "bad.jsonl:2", src=src)
    _fails(tmp_path, capsys, ["--output", str(tmp_path / "dir") + "/", "--quiet"], "bad.jsonl:2", src=src)


@pytest.mark.parametrize("argv,message", [
    (["--chunk-size", "8", "--overlap", "8"], "overlap (8) must be smaller than chunk_size (8)"),
    (["--overlap", "300"], "overlap (300) must be smaller than the default chunk_size (254)"),
    (["--model", "/no/such/model"], "model /no/such/model: no such model folder"),
    (["--shard", "2/2"], "--shard 2/2: INDEX must be in 0..COUNT-1"),
    (["--resume"], "--resume needs a shard folder output"),
    (["--truncate-dim", "385"], "truncate_dim must be an integer from 1 to 384"),
    (["--truncate-dim", "0"], "truncate_dim must be an integer >= 1"),
])
def test_bad_options(tmp_path, capsys, argv, message):
    _fails(tmp_path, capsys, ["-o", str(tmp_path / "o.npy"), "-q", *argv], message)


def test_bad_model_folder_and_unreachable_hub(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    _fails(tmp_path, capsys, ["-o", str(tmp_path / "o.npy"), "--model", str(tmp_path / "m")], "is not a model folder")
    err = _fails(tmp_path, capsys, ["-o", str(tmp_path / "o.npy"), "--model", "dice-fast-test/no-such-model"],
                 "dice-fast-test/no-such-model")
    assert "Hub" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_unavailable(tmp_path, capsys):
    _fails(tmp_path, capsys, ["-o", str(tmp_path / "o.npy"), "--device", "cuda"], "CUDA is not available")


def test_unwritable_output(tmp_path, capsys):
    (tmp_path / "file").write_text("", encoding="utf-8")
    _fails(tmp_path, capsys, ["-o", str(tmp_path / "file" / "o.npy")], "file")
    _fails(tmp_path, capsys, ["-o", str(tmp_path / "o.csv")], "unknown output type '.csv'")


def test_help_documents_every_option():
    text = subprocess.run([sys.executable, "-m", "dice_fast.cli", "encode", "--help"], capture_output=True,
                          text=True, check=True).stdout
    for flag in ("--chunk-size", "--overlap", "--positions", "--pooling", "--aggregation", "--top-k", "--temperature",
                 "--normalize-chunks", "--no-normalize", "--truncate-dim", "--strategy", "--attention", "--attention-backend",
                 "--document-prefix", "--max-chunks-per-document", "--max-batch-tokens", "--device", "--dtype",
                 "--model", "--field", "--format", "--id-field", "--queries", "--overwrite", "--resume", "--shard",
                 "--shard-rows", "Blank lines", "exit status"):
        assert flag in text


def test_progress_eta_counts_tokens_from_bytes(tmp_path):
    from dice_fast.corpus.readers import ReadProgress
    from dice_fast.progress import ProgressBar

    src = tmp_path / "d.txt"
    src.write_text("a" * 99 + "\n" + "b" * 299 + "\n", encoding="utf-8")  # 100 + 300 bytes
    corpus = open_corpus(str(src))
    bar = ProgressBar(None, show=False)
    est = ReadProgress(bar, corpus)
    for _ in corpus.records():
        est.offsets.append(corpus.bytes_read)
    est(1, 50)  # the first document (100 bytes) had 50 tokens: 200 expected in all
    assert bar.bar.total == 200 and bar.tokens == 50 and bar.documents == 1
    est(1, 100)
    assert bar.bar.total == 150 and bar.tokens == 150


def test_late_chunking_flags_reach_the_encoder(tmp_path, cached_encoders):
    """--strategy late --window-tokens --window-overlap: the rows of a late-chunking encoder, not DICE's."""
    docs = ["alpha beta gamma " * 60, "short one", "delta epsilon " * 200]
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    out = tmp_path / "late.npy"
    args = ["--chunk-size", "32", "--strategy", "late", "--window-tokens", "128", "--window-overlap", "16", "-q"]
    assert main(["encode", str(src), "-o", str(out), "--id-field", "id", *args]) == 0
    want = encoder(chunk_size=32, strategy="late", window_tokens=128, window_overlap=16).encode_documents(docs)
    assert_close(np.load(out), want, 1e-5, what="late rows")
    assert not np.allclose(np.load(out), encoder(chunk_size=32).encode_documents(docs), atol=1e-3)


def test_shards_hold_shard_rows_when_windows_straddle_them(tmp_path, cached_encoders):
    """Windows of documents (--max-batch-tokens x 64 characters) that do not line up with
    --shard-rows still give shards of exactly --shard-rows rows, committed as they fill."""
    docs = corpus_docs(23, seed=3)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    common = ["--id-field", "id", "--chunk-size", "16", "--max-batch-tokens", "32", "-q"]
    assert main(["encode", str(src), "-o", str(tmp_path / "shards") + "/", "--shard-rows", "4", *common]) == 0
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert [s["rows"] for s in manifest["shards"]] == [4, 4, 4, 4, 4, 3]
    assert [s["first_id"] for s in manifest["shards"]] == [f"doc{i:04d}" for i in range(0, 23, 4)]
    ids, _ = load_embeddings(tmp_path / "shards")
    assert ids == [f"doc{i:04d}" for i in range(23)]


def test_the_summary_counts_tokens_run_and_rates_from_the_open_model(tmp_path, capsys, monkeypatch):
    """The job's line said "(0 tokens incl. special tokens)" for a corpus found whole in the cache, as if
    it had none, and its rates counted the model's load (4.6 s of a 4.8 s run: "25 docs/s"). It now says
    the tokens were run (none) and gives rates over the encoding, the load apart; the manifest has both."""
    import time as clock

    import dice_fast.corpus.job as job

    real = job.load_encoder
    monkeypatch.setattr(job, "load_encoder", lambda args: clock.sleep(0.5) or real(args))  # a slow model load
    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(6, seed=5, words=(20, 200)))
    argv = ["encode", str(src), "-o", str(tmp_path / "out") + "/", "--cache", str(tmp_path / "cache"), "-q"]
    assert main(argv) == 0 and main(argv + ["--overwrite"]) == 0
    first, again = capsys.readouterr().out.strip().splitlines()[-2:]
    summary = json.loads((tmp_path / "out" / "manifest.json").read_text())["summary"]
    assert summary["tokens"] == 0 and summary["chunks_computed"] == 0 and summary["chunks_from_cache"] > 0
    assert summary["encode_seconds"] < summary["seconds"] - 0.5
    assert "; 0 tokens run incl. special tokens)" in again and "tokens run incl. special tokens)" in first
    opening = float(again.split(" s opening the model and input")[0].rsplit("(", 1)[1])
    assert opening >= 0.5
