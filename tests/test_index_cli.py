"""`dice-fast index` and `dice-fast search` with the bundled model: a haystack of prose documents with
one planted sentence; search prints the planted passage as the top hit's evidence."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from dice_fast.cli import main
from dice_fast.engine import DiceEncoder
from dice_fast.errors import InputError

PLANTED = "The silver key to the lighthouse is hidden beneath the third blue stone."



def _read_input(path, field, id_field):
    """(texts, ids) as `dice-fast index` reads them: the ids checked in a first pass, the texts streamed."""
    from dice_fast.index.cli import _checked_ids, _records

    ids = _checked_ids(path, field, id_field)
    return [text for _, _, text in _records(path, field, id_field)], ids

def _haystack(path, n_docs=6, chars=1500, planted_in=4):
    prose = " ".join(resources.files("dice_fast.data").joinpath("prose.txt").read_text(encoding="utf-8").split())
    docs = [prose[i * chars : (i + 1) * chars] for i in range(n_docs)]
    middle = len(docs[planted_in]) // 2
    docs[planted_in] = docs[planted_in][:middle] + " " + PLANTED + " " + docs[planted_in][middle:]
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return planted_in + 1  # the id: its line number


@pytest.fixture
def loaded_once(monkeypatch):
    """Each `DiceEncoder.from_pretrained` call with the same arguments loads the model once."""
    real, cache = DiceEncoder.from_pretrained.__func__, {}

    def load(cls, path=None, **options):
        key = (str(path), json.dumps(options, sort_keys=True, default=str))
        if key not in cache:
            cache[key] = real(cls, path, **options)
        return cache[key]

    monkeypatch.setattr(DiceEncoder, "from_pretrained", classmethod(load))


def test_search_prints_the_planted_passage(tmp_path, capsys, loaded_once):
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
    # an empty text has no chunks: a dice hit without a chunk score, printed as such (JSON: null, never
    # -Infinity, which JSON parsers refuse)
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n{"text": "the key is under the stone"}\n', encoding="utf-8")
    assert main(["index", str(tmp_path / "e.jsonl"), "-o", str(tmp_path / "e")]) == 0
    assert main(["search", str(tmp_path / "e"), "the", "-k", "2", "--scoring", "dice", "--json"]) == 0
    hits = [json.loads(line, parse_constant=pytest.fail) for line in capsys.readouterr().out.splitlines()]
    assert {h["id"]: h["chunk_score"] is None for h in hits} == {"1": True, "2": False}, hits
    assert main(["search", str(tmp_path / "e"), "the", "-k", "2", "--scoring", "dice"]) == 0
    empty = [line.split()[1] for line in capsys.readouterr().out.splitlines() if "no chunks (an empty text)" in line]
    assert empty == ["1"]


@pytest.mark.parametrize("line,message", [
    ('{"id": 5, "text": "b"}', None),
    ('{"text": "b"}', "d.jsonl:2: no id field 'id' (fields: text)"),
    ('{"id": null, "text": "b"}', "d.jsonl:2: id None is NoneType, expected a string or an integer"),
    ('{"id": 1.5, "text": "b"}', "d.jsonl:2: id 1.5 is float, expected a string or an integer"),
    ('{"id": true, "text": "b"}', "d.jsonl:2: id True is bool, expected a string or an integer"),
    ('{"id": "x\\ud800", "text": "b"}', "d.jsonl:2: id field 'id' is not valid Unicode: a lone surrogate"),
    ('{"id": "y", "text": "b \\udc00"}', "d.jsonl:2: field 'text' is not valid Unicode: a lone surrogate"),
    ('{"id": "y", "body": "b"}', "d.jsonl:2: no field 'text' (fields: id, body)"),
])
def test_index_ids_are_checked_as_encode_checks_them(tmp_path, capsys, line, message):
    """An id is never invented: a record without the id field, a null, a float or a bool id stops
    `dice-fast index` naming file:line, before any model is loaded, as `dice-fast encode` does."""
    src = tmp_path / "d.jsonl"
    src.write_text('{"id": "a", "text": "first"}\n' + line + "\n", encoding="utf-8")
    if message is None:
        assert _read_input(str(src), "text", "id") == (["first", "b"], ["a", "5"])
        return
    assert main(["index", str(src), "-o", str(tmp_path / "ix"), "--id-field", "id"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src.parent}/{message}" in err, err
    assert not (tmp_path / "ix").exists()


@pytest.mark.parametrize("url", ["qdrant+path://{tmp}/typo_q/docs", "lancedb://{tmp}/typo_l/docs",
                                 "lancedb://{tmp}/db/nope"])
def test_search_of_a_store_that_does_not_exist_creates_nothing(tmp_path, capsys, url):
    """A typo in a store URL is refused naming the collection / table; no folder or lock file is made
    (it made typo_q/.lock and typo_l/, and suggested dim= or encoder=, which the command has not)."""
    pytest.importorskip("qdrant_client")
    pytest.importorskip("lancedb")
    (tmp_path / "db").mkdir()
    assert main(["search", url.format(tmp=tmp_path), "hello"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "dim=" not in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["db"]


def test_an_existing_index_is_refused_unless_overwrite(tmp_path, capsys, loaded_once, monkeypatch):
    """`dice-fast index` replaced an existing index silently, where `encode` refuses an existing output:
    it refuses it now, before any model loads, and --overwrite replaces it."""
    import dice_fast.cliargs as cliargs

    src, ix = tmp_path / "d.txt", tmp_path / "ix"
    src.write_text("one river\ntwo stones\n", encoding="utf-8")
    assert main(["index", str(src), "-o", str(ix), "--chunk-size", "16"]) == 0
    before = {p.name: p.read_bytes() for p in ix.iterdir()}
    real = cliargs.make_encoder
    monkeypatch.setattr(cliargs, "make_encoder", lambda args: pytest.fail("the model loaded"))
    capsys.readouterr()
    assert main(["index", str(src), "-o", str(ix), "--chunk-size", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{ix} already holds an index; pass --overwrite to replace it" in err, err
    assert {p.name: p.read_bytes() for p in ix.iterdir()} == before
    monkeypatch.setattr(cliargs, "make_encoder", real)
    src.write_text("one river\ntwo stones\nthree clouds\n", encoding="utf-8")
    assert main(["index", str(src), "-o", str(ix), "--chunk-size", "16", "--overwrite"]) == 0
    assert "3 documents" in capsys.readouterr().err
    assert main(["index", "push", str(ix), "--to", f"lancedb://{tmp_path}/l/t", "--overwrite"]) == 2
    assert "usage: dice-fast index push OUT --to URL" in capsys.readouterr().err


def test_an_unusable_output_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A file, a foreign folder, a folder under a read-only one: `dice-fast index` encoded the whole
    corpus (13-26 s on a small one) before save refused it."""
    import os

    import dice_fast.cliargs as cliargs

    monkeypatch.setattr(cliargs, "make_encoder", lambda args: pytest.fail("the model loaded"))
    src = tmp_path / "d.txt"
    src.write_text("one river\ntwo stones\n", encoding="utf-8")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    (tmp_path / "ro").mkdir(mode=0o500)
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    cases = [("afile", "exists and is not a folder"), ("foreign", "holds no dice_fast index"),
             ("gone", "exists and is not a folder (a link to nothing)"), ("afile/idx", "afile is not a folder")]
    if os.geteuid() != 0:  # root may write anywhere
        cases.append(("ro/idx", "is not writable"))
    for out, said in cases:
        assert main(["index", str(src), "-o", str(tmp_path / out)]) == 2, out
        assert said in capsys.readouterr().err, out
    assert sorted(p.name for p in (tmp_path / "foreign").iterdir()) == ["notes.txt"]


def test_alpha_without_hybrid_scoring_is_refused(tmp_path, capsys):
    """--alpha weighs only the hybrid scoring; with maxsim (the default) it was silently ignored."""
    assert main(["search", str(tmp_path / "none"), "hello", "--alpha", "0.5"]) == 2
    assert "--alpha weighs the hybrid scoring; pass --scoring hybrid" in capsys.readouterr().err


@pytest.fixture
def no_model(monkeypatch):
    import dice_fast.cliargs as cliargs

    monkeypatch.setattr(cliargs, "make_encoder", lambda args: pytest.fail("the model loaded"))


def _plain_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a"], "text": ["one"]}), path)
    return path


def test_index_extensions_in_any_case(tmp_path, capsys, no_model):
    """`dice-fast index` refused UP.JSONL (and read X.PARQUET as texts), which `dice-fast encode` reads."""
    (tmp_path / "UP.JSONL").write_text('{"id": "a", "text": "one"}\n{"id": 2, "text": "two"}\n', encoding="utf-8")
    (tmp_path / "UP.Ndjson").write_text('{"text": "one"}\n', encoding="utf-8")
    (tmp_path / "UP.TXT").write_text("one\n\ntwo\n", encoding="utf-8")
    assert _read_input(str(tmp_path / "UP.JSONL"), "text", "id") == (["one", "two"], ["a", "2"])
    assert _read_input(str(tmp_path / "UP.Ndjson"), "text", None) == (["one"], ["1"])
    assert _read_input(str(tmp_path / "UP.TXT"), "text", None) == (["one", "two"], ["1", "3"])
    with pytest.raises(InputError, match=r"UP\.TXT is a \.txt file .* --id-field 'id' cannot apply"):
        _read_input(str(tmp_path / "UP.TXT"), "text", "id")  # as encode refuses it: a line has no fields
    src = _plain_parquet(tmp_path / "PLAIN.PARQUET")
    assert main(["index", str(src), "-o", str(tmp_path / "ix")]) == 2
    assert f"{src}: not an output of `dice-fast encode --chunks`" in capsys.readouterr().err
    assert main(["index", str(tmp_path / "d.csv"), "-o", str(tmp_path / "ix")]) == 2
    assert "expected a .txt, .jsonl or .ndjson file" in capsys.readouterr().err
    assert not (tmp_path / "ix").exists()


def test_index_duplicate_id_names_file_and_lines(tmp_path, capsys, no_model):
    """A duplicate id was refused as "duplicate id 'x': ids[0] and ids[1]", naming no file or line."""
    src = tmp_path / "d.jsonl"
    src.write_text('{"id": "x", "text": "a"}\n{"id": "y", "text": "b"}\n\n{"id": "x", "text": "c"}\n', encoding="utf-8")
    assert main(["index", str(src), "-o", str(tmp_path / "ix"), "--id-field", "id"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"duplicate id 'x': {src}:1 and {src}:4" in err, err
    assert not (tmp_path / "ix").exists()


def test_index_of_a_parquet_that_is_not_an_encode_output(tmp_path, capsys, no_model):
    """A Parquet corpus of texts got "no dice_fast options in its metadata ('NoneType' object is not
    subscriptable)"; it is named as not an `encode --chunks` output, with the command that makes one."""
    src = _plain_parquet(tmp_path / "plain.parquet")
    assert main(["index", str(src), "-o", str(tmp_path / "ix")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src}: not an output of `dice-fast encode --chunks`" in err, err
    assert f"encode it first: dice-fast encode {src} -o OUT.parquet --chunks" in err and "NoneType" not in err, err
    (tmp_path / "junk.parquet").write_text("not parquet", encoding="utf-8")
    assert main(["index", str(tmp_path / "junk.parquet"), "-o", str(tmp_path / "ix")]) == 2
    assert f"{tmp_path / 'junk.parquet'}: not a readable Parquet file" in capsys.readouterr().err
    assert not (tmp_path / "ix").exists()


def test_model_and_option_flags_beside_an_encode_output_are_refused(tmp_path, capsys, no_model):
    """An encode --chunks output is indexed as it was encoded: `--chunk-size 64 --model /no/such/folder`
    beside it built an index recording chunk size 8 and exited 0. Now every such flag is named."""
    src = _plain_parquet(tmp_path / "out.parquet")
    flags = ["--model", "/no/such/folder", "--chunk-size", "64", "--no-normalize", "--field", "body", "--no-store-text"]
    assert main(["index", str(src), "-o", str(tmp_path / "ix"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src} is an encode --chunks output" in err, err
    assert "--model, --chunk-size, --no-normalize, --field, --[no-]store-text would change nothing" in err, err
    assert main(["index", str(src), "-o", str(tmp_path / "ix"), "--chunk-dtype", "float16"]) == 2  # a storage choice
    assert "not an output of `dice-fast encode --chunks`" in capsys.readouterr().err
    assert not (tmp_path / "ix").exists()
