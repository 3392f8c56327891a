"""The eval run: aggregations derived from one chunk encoding equal encode_documents; run_eval's metrics
equal direct retrieval; a local BEIR folder end to end."""

from __future__ import annotations

import json

import pytest

from dice_fast import DiceEncoder
from dice_fast.eval.plots import plot_hit_vs_length
from dice_fast.eval.report import format_report
from dice_fast.eval.retrieval import evaluate
from dice_fast.eval.run import DEFAULT_AGGREGATIONS, aggregate_from_chunks, raw_twin, run_eval
from dice_fast.eval.tasks import load_local_task, make_passkey_task
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


def test_run_eval_metrics_match_direct_retrieval(tiny_result):
    enc, task, res = tiny_result
    assert res.groups == [64, 128]
    assert res.methods == ["single"] + [f"k{k}-{a}" for k in (16, 40)
                                        for a in ("mean", "max", "topk_norm", "maxsim", "hybrid@0.3")]
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


def test_normalize_chunks_ablation_from_one_encoding(tmp_path):
    """Both settings derived from the same raw chunk vectors (one encoding: a second run is all cache)
    equal encode_documents with that setting; the keys carry the setting."""
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok)
    task = make_passkey_task(tok, lengths=(64,), docs_per_length=3, queries_per_length=2, seed=2)
    kw = dict(chunk_sizes=(16,), aggregations=("mean", "max"), show_progress=False, log=None, check_docs=1,
              normalize_chunks=(True, False), cache_dir=tmp_path)
    res = run_eval(task, enc, **kw)
    assert res.methods == ["single", "k16-mean-norm", "k16-max-norm", "k16-mean-raw", "k16-max-raw", "k16-maxsim",
                           "k16-hybrid-norm", "k16-hybrid-raw"]
    assert max(res.check.values()) < 1e-5  # each setting's vectors equal the engine's with that setting
    assert res.method_info["k16-max-raw"]["normalize_chunks"] is False
    again = run_eval(task, enc, **kw)
    assert again.timings["k16"]["tokens"] == 0 and again.timings["single"]["tokens"] == 0  # all from the cache
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".sqlite"] == ["chunks.sqlite"]  # the core's cache
    assert again.metrics == res.metrics
    with pytest.raises(ValueError, match="hybrid_alphas"):
        run_eval(task, enc, chunk_sizes=(16,), hybrid_alphas=(1.5,), show_progress=False, log=None)
