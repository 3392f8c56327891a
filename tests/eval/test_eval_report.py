"""The report: macro averages and tables on hand-made numbers; the markdown report, CSV rows and PNGs of
a tiny run."""

from __future__ import annotations

import csv

import pytest

from dice_fast.eval.plots import plot_edi, plot_hit_vs_length
from dice_fast.eval.report import format_report, format_table, macro_average, write_csv


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
