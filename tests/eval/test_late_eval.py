"""Late chunking in the evaluation: run_eval's late rows equal encode_documents of a late encoder and
direct retrieval; the boundary task is deterministic and puts its answer across a chunk boundary."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from dice_fast import DiceEncoder
from dice_fast.eval.boundary import make_boundary_task
from dice_fast.eval.report import csv_rows, format_report
from dice_fast.eval.retrieval import evaluate
from dice_fast.eval.run import aggregate_from_chunks, raw_twin, run_eval
from dice_fast.eval.tasks import make_passkey_task
from dice_fast.models import default_model_path
from helpers import assert_close
from tiny_models import tiny

TEXTS = ["alpha beta gamma delta " * 30, "", "short one", "numbers 1 2 3 4 5 6 7 8 9 10 " * 12]


@pytest.mark.parametrize("agg", ["mean", "max", "weighted_mean", "topk_norm", "softmax_norm"])
def test_late_aggregations_from_chunks_equal_encode_documents(agg):
    model, tok, *_ = tiny("bert")
    base = DiceEncoder(model, tok, chunk_size=7, strategy="late", window_tokens=40)
    raw = raw_twin(base, normalize_chunks=False).encode_documents(TEXTS, return_chunks=True)
    enc = raw_twin(base, aggregation=agg)
    assert_close(aggregate_from_chunks(enc, raw, agg), enc.encode_documents(TEXTS), 1e-6, 1e-6, what=agg)


def test_run_eval_late_rows():
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok)
    task = make_passkey_task(tok, lengths=(64, 128), docs_per_length=4, queries_per_length=3, seed=1)
    res = run_eval(task, enc, chunk_sizes=(16,), aggregations=("mean", "max"), scorings=("maxsim",),
                   strategies=("dice", "late"), check_docs=3, show_progress=False, log=None)
    assert res.methods == ["single", "k16-mean", "k16-max", "k16-maxsim", "late-k16-mean", "late-k16-max",
                           "late-k16-maxsim"]
    assert max(res.check.values()) < 1e-5 and "late-k16-max" in res.check
    late = raw_twin(enc, chunk_size=16, strategy="late", aggregation="max").encode_documents(task.corpus)
    q = enc.encode_queries(task.queries)
    ev = evaluate(q, late, task.qrels, query_groups=task.query_length, doc_groups=task.doc_length)
    for g in (64, 128):
        assert res.metrics["late-k16-max"]["hit@1"][g] == pytest.approx(ev["groups"][g]["hit@1"])
    assert set(res.edi) == {16, "16 late"}
    report = format_report(res)
    assert "late MaxSim k=16" in report and "late max k=16" in report
    assert any(r["method"] == "late-k16-mean" for r in csv_rows(res))
    with pytest.raises(ValueError, match="strategies"):
        run_eval(task, enc, chunk_sizes=(16,), strategies=("single",), show_progress=False, log=None)


def test_boundary_task_is_deterministic_and_splits_its_answer():
    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    a, b = make_boundary_task(tok, docs=20, seed=3), make_boundary_task(tok, docs=20, seed=3)
    assert a.corpus == b.corpus and a.queries == b.queries
    assert make_boundary_task(tok, docs=20, seed=4).corpus != a.corpus
    assert len(a.corpus) == len(a.queries) == 20 and all(qr == {i: 1} for i, qr in enumerate(a.qrels))
    assert abs(np.asarray(a.doc_tokens) - 384).max() <= 8
    for i, doc in enumerate(a.corpus):
        pet = doc[a.answer_span[i, 0]:a.answer_span[i, 1]]
        assert f"called {pet}." in doc
        name = a.queries[i].split("What is ")[1].split("'s ")[0]
        assert doc.count(name) == 1 and sum(name in d for d in a.corpus) == 2  # two pets per person
        before = len(tok(doc[:doc.index(name + " has a new pet.") + len(name + " has a new pet.")],
                         add_special_tokens=False)["input_ids"])
        assert abs(before - 256) <= 8, "the name's sentence ends near token 256"
    with pytest.raises(ValueError, match="docs"):
        make_boundary_task(tok, docs=3)


@pytest.fixture(scope="module")
def dice_and_late():
    """(encoder, task, EvalResult) of one tiny run with both strategies, the normalize_chunks ablation and an
    alpha grid: every key DICE and late chunking could collide on."""
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok)
    task = make_passkey_task(tok, lengths=(64, 128), docs_per_length=4, queries_per_length=3, seed=1)
    res = run_eval(task, enc, chunk_sizes=(16,), aggregations=("mean",), scorings=("maxsim", "hybrid"),
                   strategies=("dice", "late"), normalize_chunks=(True, False), hybrid_alphas=(0.0, 0.5),
                   check_docs=0, show_progress=False, log=None)
    return enc, task, res


def test_dice_and_late_plots_draw_each_strategy_once(dice_and_late, tmp_path):
    from dice_fast.eval.cli import write_outputs
    from dice_fast.eval.plots import _line_label, _panel

    _, _, res = dice_and_late
    assert res.method_info["late-k16-mean-norm"]["strategy"] == "late"
    assert res.method_info["k16-maxsim"]["strategy"] == "dice" and res.method_info["single"]["strategy"] == "single"
    # the EDI panel of DICE's chunk size holds DICE's aggregations only; late chunking's has its own
    own = "norm" if res.extra["default_normalize_chunks"] else "raw"  # the panels draw the run's own setting
    assert [m for m, _ in _panel(res, 16, ("dice",), ("dice",))] == [f"k16-mean-{own}"]
    assert [m for m, _ in _panel(res, 16, ("dice",), ("late",))] == [f"late-k16-mean-{own}"]
    assert _line_label("mean", "late") == "late mean" and _line_label("maxsim", "late") == "late MaxSim"
    assert _line_label("mean", "dice") == "DICE mean" and _line_label("maxsim", "dice") == "MaxSim"
    written = write_outputs(res, tmp_path, "both", tmp_path / "r.csv", plots=True)  # was KeyError 'late-k16-mean'
    assert any(w.endswith("both-edi.png") for w in written) and any(w.endswith("both-hit1.png") for w in written)
    timing = {r["method"]: r["chunk_size"] for r in csv_rows(res) if r["metric"] == "encode_seconds"}
    assert timing == {"queries": "", "single": "", "k16": "16", "late-k16": "16"}


def test_ablation_keeps_dice_and_late_apart(dice_and_late):
    from dice_fast.eval.ablation import _variants, alpha_table, normalize_chunks_table
    from dice_fast.eval.report import macro_average

    _, _, res = dice_and_late
    assert _variants(res) == {("dice", 16, "mean"): {True: "k16-mean-norm", False: "k16-mean-raw"},
                              ("late", 16, "mean"): {True: "late-k16-mean-norm", False: "late-k16-mean-raw"}}

    def pct(key, metric="hit@1"):
        return f"{100 * macro_average(res.metrics[key][metric], res.length_split)['avg']:.1f}"

    md, _ = normalize_chunks_table([res])
    assert f"| 16 | mean | {pct('k16-mean-norm')} | {pct('k16-mean-raw')} |" in md
    assert f"| 16 late | mean | {pct('late-k16-mean-norm')} | {pct('late-k16-mean-raw')} |" in md
    md, _ = alpha_table([res], normalize_chunks=True)
    assert md.splitlines()[0] == "| alpha | passkey k=16 | passkey late k=16 | mean |"
    row = next(line for line in md.splitlines() if line.startswith("| 0.5 |"))
    assert row.startswith(f"| 0.5 | {pct('k16-hybrid-norm@0.5')} | {pct('late-k16-hybrid-norm@0.5')} |")


def test_run_eval_refuses_before_any_encoding(monkeypatch):
    """What late chunking refuses (overlap), and an alpha grid without the hybrid, fail before the queries,
    single or any DICE chunk size is encoded."""
    from dice_fast.errors import OptionError
    from dice_fast.eval import chunkstore

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, overlap=4)
    task = make_passkey_task(tok, lengths=(64,), docs_per_length=2, queries_per_length=1, seed=1)
    encoded = []
    monkeypatch.setattr(chunkstore, "encode_raw_chunks", lambda *a, **k: encoded.append(a) or 1 / 0)
    monkeypatch.setattr(enc, "encode_queries", lambda *a, **k: encoded.append(a) or 1 / 0)
    with pytest.raises(OptionError, match="overlap"):
        run_eval(task, enc, chunk_sizes=(16, 32), aggregations=("mean",), strategies=("dice", "late"),
                 show_progress=False, log=None)
    with pytest.raises(OptionError, match=r"hybrid_alphas.*scorings"):
        run_eval(task, enc, chunk_sizes=(16,), scorings=("maxsim",), hybrid_alphas=(0.5,), show_progress=False,
                 log=None)
    assert encoded == []
