"""The benchmark harness: rows, ratios, FLOPs, the CSV, the table and the command (functional, not timed)."""

from __future__ import annotations

import argparse
import csv
import math

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder
from dice_fast.bench.measure import model_flops
from dice_fast.bench.run import FIELDS, benchmark, format_table, save_rows
from test_bench_baselines import K, corpus
from tiny_models import tiny


def test_benchmark_rows_and_csv(tmp_path):
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=8)
    texts = [t for t in corpus() if t][:6]
    rows = benchmark({"float32": enc}, texts, "unit", "tiny-bert", repeats=1, padded_batch=3, peak_tflops=1.0)
    assert [r.path for r in rows] == ["dice_fast", "padded_sorted", "padded_naive"]
    for r in rows:
        assert r.seconds_median > 0 and r.docs_per_s > 0 and r.min_cosine_vs_engine > 0.99999
        assert r.min_cosine_vs_fp32_engine == r.min_cosine_vs_engine and r.padded_batch == 3
    assert rows[0].n_docs == 6 and rows[0].doc_tokens == sum(len(t.split()) for t in texts)
    engine, srt, nai = rows
    assert srt.speedup_vs_padded_sorted == 1.0 and nai.speedup_vs_padded_naive == 1.0
    assert math.isclose(engine.speedup_vs_padded_sorted, srt.seconds_median / engine.seconds_median)
    assert math.isclose(engine.speedup_vs_padded_naive, nai.seconds_median / engine.seconds_median)
    assert engine.speedup_vs_best_naive == min(engine.speedup_vs_padded_sorted, engine.speedup_vs_padded_naive)
    assert engine.tflops > 0 and engine.mfu == engine.tflops and math.isnan(srt.tflops)
    assert engine.attention.startswith(enc.backend) and srt.attention == "sdpa"  # + "(fp32)" once CPU attention is tuned
    out = tmp_path / "r.csv"
    assert save_rows(rows, out) == 3
    save_rows(rows, out)
    with open(out) as fh:
        read = list(csv.DictReader(fh))
    assert len(read) == 6 and list(read[0]) == FIELDS
    table = format_table(rows)
    assert "| tiny-bert | unit | dice_fast | float32 |" in table and "| padded_naive |" in table


def test_the_engine_runs_every_chunk_of_a_corpus_that_repeats_itself(monkeypatch):
    """The engine's row reused repeated chunks (on by default) where the padded paths ran them all: a
    corpus that repeats a passage timed the engine on fewer chunks (the "long" corpus repeats the whole
    bundled prose in every document over 38k tokens)."""
    from dice_fast.bench.run import encode_plan

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=8)
    texts = [t for t in corpus() if t][:4] * 3
    plan, queues, make = enc.plan(texts), [], enc.chunk_queue
    monkeypatch.setattr(enc, "chunk_queue", lambda *a, **k: queues.append(make(*a, **k)) or queues[-1])
    encode_plan(enc, plan)
    assert queues[0].stats.snapshot()["computed"] == plan.n_chunks


def test_benchmark_sentence_transformers_row(tmp_path):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    model, tok, *_ = tiny("bert")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    st = SentenceTransformer(modules=[Transformer(str(tmp_path), max_seq_length=64), Pooling(32, "mean")], device="cpu")
    enc = DiceEncoder(model, tok, chunk_size=8)
    rows = benchmark({"float32": enc}, corpus()[:5], "unit", "tiny-bert", repeats=1, st_model=st)
    assert [r.path for r in rows] == ["dice_fast", "padded_sorted", "padded_naive", "sentence_transformers"]
    assert rows[-1].min_cosine_vs_engine > 0.99999
    best = min(r.seconds_median for r in rows[1:])  # the fastest naive path
    assert math.isclose(rows[0].speedup_vs_best_naive, best / rows[0].seconds_median)


def test_model_flops_counts_the_plans_chunks():
    model, tok, *_ = tiny("bert")  # bidirectional, [CLS] text [SEP]
    enc = DiceEncoder(model, tok, chunk_size=K)
    texts = corpus()
    lengths = []  # wrapped chunk lengths, from the word counts alone
    for t in texts:
        n = len(t.split())
        lengths += [min(K, n - s) + 2 for s in range(0, max(n, 1), K)]
    lengths = np.array(lengths, dtype=np.float64)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "pooler" not in n)
    c = model.config
    want = 2.0 * params * lengths.sum() + 4.0 * c.num_hidden_layers * c.hidden_size * (lengths**2).sum()
    assert math.isclose(model_flops(enc, texts), want, rel_tol=1e-12)


def test_save_rows_widens_an_older_csv(tmp_path):
    model, tok, *_ = tiny("bert")
    rows = benchmark({"float32": DiceEncoder(model, tok, chunk_size=8)}, corpus()[:3], "unit", "tiny-bert", repeats=1)
    out = tmp_path / "old.csv"
    out.write_text("date,path,speedup_vs_best_naive,gone\n2025-01-01,padded,1.5,x\n", encoding="utf-8")
    save_rows(rows, out)
    with open(out) as fh:
        reader = csv.DictReader(fh)
        read = list(reader)
    assert reader.fieldnames == ["date", "path", "speedup_vs_best_naive", "gone"] + [
        f for f in FIELDS if f not in ("date", "path", "speedup_vs_best_naive")]
    assert read[0]["path"] == "padded" and read[0]["gone"] == "x" and read[0]["model"] == ""
    assert [r["path"] for r in read[1:]] == ["dice_fast", "padded_sorted", "padded_naive"]
    bad = tmp_path / "bad.csv"  # a row with more values than the header: refused, file untouched
    bad.write_text("date,path\n2025-01-01,padded\n2025-01-02,padded,0.9\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.csv:3: 3 values under a header of 2 columns"):
        save_rows(rows, bad)
    assert bad.read_text(encoding="utf-8").count("\n") == 3


def test_cli_bench_arguments(tmp_path, capsys):
    from dice_fast.bench.cli import cmd_bench, register_cli

    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--corpus", "short", "--docs", "2", "--repeats", "1", "--dtype", "float32",
                              "--padded-batch", "4", "--csv", str(tmp_path / "b.csv"), "--device", "cpu"])
    assert args.func is cmd_bench and args.chunk_size is None and args.aggregation == "mean"
    assert cmd_bench(args) == 0
    printed = capsys.readouterr().out
    assert "| short | sentence_transformers | float32 | sdpa |" in printed and "| short | padded_naive |" in printed
    with open(tmp_path / "b.csv") as fh:
        read = list(csv.DictReader(fh))
    assert [r["path"] for r in read] == ["dice_fast", "padded_sorted", "padded_naive", "sentence_transformers"]
    assert all(float(r["min_cosine_vs_engine"]) > 0.999 for r in read)
    with pytest.raises(ValueError, match="--docs must be >= 1"):
        cmd_bench(parser.parse_args(["bench", "--docs", "0"]))


def test_model_flops_use_the_attention_width_not_hidden_size():
    """Qwen3 sets head_dim independently of hidden_size (0.6B: 16 heads x 128 = 2048 at hidden 1024):
    attention FLOPs scale with heads x head_dim; for BERT that product is hidden_size."""
    from dice_fast.bench.measure import attention_width

    import copy

    import transformers

    base, tok, *_ = tiny("qwen3")
    c = copy.deepcopy(base.config)
    c.head_dim = 2 * c.hidden_size // c.num_attention_heads  # attention twice as wide as the residual stream
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(c).eval()
    assert attention_width(c) == c.num_attention_heads * c.head_dim == 2 * c.hidden_size
    enc = DiceEncoder(model, tok, chunk_size=K)
    lengths = enc.plan(corpus()).chunk_lengths.astype(np.float64)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "pooler" not in n)
    want = 2.0 * params * lengths.sum() + 0.5 * 4.0 * c.num_hidden_layers * attention_width(c) * (lengths**2).sum()
    assert math.isclose(model_flops(enc, plan=enc.plan(corpus())), want, rel_tol=1e-12)
    bert = tiny("bert")[0].config
    assert attention_width(bert) == bert.hidden_size


def test_every_committed_csv_can_be_appended_to():
    """benchmarks/results.csv, `dice-fast bench`'s default output, held five rows from a version with one
    more column than its header: every `dice-fast bench` run from the repository refused to append
    ("23 values under a header of 22 columns"). Every CSV the repository ships reads as its header says."""
    from pathlib import Path

    from dice_fast.runinfo import check_csv

    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "benchmarks").rglob("*.csv"))
    assert root / "benchmarks" / "results.csv" in files
    for path in files:
        assert check_csv(path), path  # a header, and no row wider than it (ValueError naming the line)
