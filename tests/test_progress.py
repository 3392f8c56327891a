"""The progress bar where stderr is a log file: a line now and then, not a bar redrawn into one line."""

import re

from dice_fast.progress import ProgressBar


def test_a_log_gets_lines_not_a_redrawn_bar(capsys):
    """Under pytest stderr is no terminal, as in a batch job's log: tqdm redrew its bar ten times a
    second with carriage returns, one line growing by megabytes an hour. Now a whole line every
    ``line_seconds``, the last one at close, with the ETA where the total is known."""
    bar = ProgressBar(1000, desc="encode documents", line_seconds=0.0)
    bar(3, 250)
    bar(2, 250)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert "\r" not in "".join(lines) and len(lines) == 3, lines
    assert re.fullmatch(r"encode documents: 250 tokens of ~1,000 \(25 %\), 3 docs, [\d,]+ tok/s, 0:00:00, ~0:00:\d\d left",
                        lines[0]), lines[0]
    assert lines[1].startswith("encode documents: 500 tokens of ~1,000 (50 %), 5 docs") and lines[2].startswith(lines[1][:40])


def test_a_short_job_in_a_log_prints_nothing_and_a_hidden_bar_nothing_at_all(capsys):
    bar = ProgressBar(None, desc="encode")  # 30 s between lines: a short job has none, not even at close
    bar(1, 10)
    bar.close()
    hidden = ProgressBar(None, show=False, line_seconds=0.0)
    hidden(1, 10)
    hidden.close()
    assert capsys.readouterr().err == "" and (bar.tokens, hidden.documents) == (10, 1)


def test_after_a_long_batch_one_line_and_a_closed_stderr_costs_nothing(capsys, monkeypatch):
    """Each line paid back one 30 s slot: after a 300 s batch the next ten updates each printed a line.
    And a closed stderr made the first line raise, ending the encode it reported on."""
    import io
    import time

    bar = ProgressBar(None, desc="encode", line_seconds=30.0)
    bar.t0 = time.perf_counter() - 300  # the first batch took 300 s
    for _ in range(5):
        bar(1, 10)
    assert len(capsys.readouterr().err.splitlines()) == 1
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr("sys.stderr", closed)
    quiet = ProgressBar(None, line_seconds=0.0)
    quiet(1, 10)
    quiet.close()
    assert quiet.tokens == 10 and not quiet.lines


def test_a_query_bar_never_ends_short_of_its_total(monkeypatch):
    """encode_queries' bar had the planned tokens as its total while it counts the tokens run: ten copies of
    one query ended at 4 of 40 tokens (10 %). A bar whose total is known must reach it."""
    import dice_fast.progress as progress
    from dice_fast import DiceEncoder
    from tiny_models import tiny

    bars = []

    class Recorded(progress.ProgressBar):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(progress, "ProgressBar", Recorded)
    model, tok, *_ = tiny("bert")
    DiceEncoder(model, tok).encode_queries(["the same query"] * 10, show_progress=True)
    [bar] = bars
    assert bar.bar.total is None or bar.tokens == bar.bar.total, (bar.tokens, bar.bar.total)
    assert bar.documents == 10
