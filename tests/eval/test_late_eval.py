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
