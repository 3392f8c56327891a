"""`dice-fast index` and `dice-fast search` with the bundled model: a haystack of prose documents with
one planted sentence; search prints the planted passage as the top hit's evidence."""

from __future__ import annotations

import json
from importlib import resources

from dice_fast.cli import main

PLANTED = "The silver key to the lighthouse is hidden beneath the third blue stone."


def _haystack(path, n_docs=6, chars=1500, planted_in=4):
    prose = " ".join(resources.files("dice_fast.data").joinpath("prose.txt").read_text(encoding="utf-8").split())
    docs = [prose[i * chars : (i + 1) * chars] for i in range(n_docs)]
    middle = len(docs[planted_in]) // 2
    docs[planted_in] = docs[planted_in][:middle] + " " + PLANTED + " " + docs[planted_in][middle:]
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return planted_in + 1  # the id: its line number


def test_search_prints_the_planted_passage(tmp_path, capsys):
    planted_id = _haystack(tmp_path / "haystack.txt")
    assert main(["index", str(tmp_path / "haystack.txt"), "-o", str(tmp_path / "ix"), "--chunk-size", "48",
                 "--chunk-dtype", "float16"]) == 0
    query = "Where is the silver key to the lighthouse hidden?"
    assert main(["search", str(tmp_path / "ix"), query, "-k", "3", "--scoring", "maxsim"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"query: {query}"
    top = lines[1]
    assert top.split()[:2] == ["1", str(planted_id)], lines
    assert PLANTED in top
    assert main(["search", str(tmp_path / "ix"), query, "-k", "1", "--scoring", "hybrid", "--json"]) == 0
    hit = json.loads(capsys.readouterr().out)
    assert hit["id"] == str(planted_id) and PLANTED in hit["text"]
    assert main(["search", str(tmp_path), "q"]) == 2
    assert "no index.json" in capsys.readouterr().err
