"""What the benchmark reports beside wall time: tokenization apart from the model, per-dtype MFU,
the round budget, timings flushed as they are taken (functional, not timed)."""

from __future__ import annotations

import argparse
import csv
import math
import time

import pytest
import torch

from dice_fast import DiceEncoder
from dice_fast.bench import measure
from dice_fast.bench.run import benchmark, encode_plan, format_table
from test_bench_baselines import corpus
from tiny_models import tiny


@pytest.fixture(scope="module")
def enc():
    model, tok, *_ = tiny("bert")
    return DiceEncoder(model, tok, chunk_size=8)


def test_engine_row_reports_tokenization_apart_and_mfu_per_dtype(enc):
    texts = [t for t in corpus() if t][:6]
    rows = benchmark({"float32": enc}, texts, "unit", "tiny-bert", repeats=1, padded_batch=3,
                     peak_tflops={"float32": 2.0})
    engine = rows[0]
    assert engine.path == "dice_fast" and engine.matmul_tflops == 2.0
    assert math.isclose(engine.mfu, engine.tflops / 2.0)
    plan = enc.plan(texts)
    assert math.isclose(engine.flops_per_token, measure.model_flops(enc, plan=plan) / plan.chunk_lengths.sum())
    assert engine.e2e_seconds > 0 and engine.tokenize_seconds > 0 and 0.0 <= engine.tokenize_overlap <= 1.0
    assert math.isclose(engine.tokenizer_tokens_per_s, engine.doc_tokens / engine.tokenize_seconds)
    assert all(math.isnan(r.e2e_seconds) and math.isnan(r.mfu) for r in rows[1:])
    assert -1.0 <= engine.cosine_between_docs < 1.0
    assert "end-to-end tokens/s" in format_table(rows)


def test_encode_plan_is_the_engine_without_its_tokenizer(enc):
    texts = corpus()
    got = encode_plan(enc, enc.plan(texts))
    want = enc.encode_documents(texts)
    assert got.shape == want.shape and float(abs(got - want).max()) < 1e-6


def test_run_paths_reports_each_timing_and_keeps_to_its_budget():
    seen = []

    def slow():
        time.sleep(0.05)
        return 1

    res = measure.run_paths({"a": slow, "b": lambda: 2}, repeats=50, device=torch.device("cpu"),
                            on_time=lambda *x: seen.append(x), budget_s=0.2)
    n = len(res["a"][0])
    assert 1 <= n < 10 and len(res["b"][0]) == n  # stopped by the budget, every path in every round
    assert [(name, r) for name, r, _ in seen] == [(p, r) for r in range(n) for p in ("a", "b")]
    res = measure.run_paths({"a": slow}, repeats=2, device=torch.device("cpu"), budget_s=0.0)
    assert len(res["a"][0]) == 1  # at least one timed round


def test_cpu_matmul_rate_is_bounded_in_time():
    t0 = time.perf_counter()
    rate = measure.matmul_tflops(torch.device("cpu"), torch.float32, min_seconds=0.01)
    assert rate > 0 and time.perf_counter() - t0 < 10


def test_cli_flushes_raw_timings_and_measures_each_dtype(tmp_path, monkeypatch, capsys):
    from dice_fast.bench import cli

    monkeypatch.setattr(measure, "matmul_tflops", lambda device, dtype, **k: {torch.float32: 1.0}[dtype])
    parser = argparse.ArgumentParser()
    cli.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--corpus", "short", "--docs", "2", "--repeats", "2", "--dtype", "float32",
                              "--padded-batch", "4", "--csv", str(tmp_path / "b.csv"), "--raw-csv", str(tmp_path / "r.csv"),
                              "--device", "cpu", "--no-sentence-transformers", "--flops", "--budget-s", "600"])
    assert cli.cmd_bench(args) == 0
    assert "float32 1 TFLOP/s" in capsys.readouterr().out
    raw = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert {r["path"] for r in raw} == {"dice_fast", "padded_sorted", "padded_naive", "end_to_end", "tokenize"}
    assert sorted({int(r["round"]) for r in raw}) == [0, 1] and all(float(r["seconds"]) > 0 for r in raw)
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert float(rows[0]["matmul_tflops"]) == 1.0 and float(rows[0]["mfu"]) == float(rows[0]["tflops"])
