"""Retrieval tasks: LongEmbed-style synthetic *passkey* / *needle* tasks, and local BEIR folders.

    task = make_passkey_task(tok, lengths=(256, 1024, 8192), seed=0)
    task = make_needle_task(tok, seed=0)                     # all 8 LongEmbed lengths, 100 docs each
    task = load_local_task("path/to/beir_folder")            # corpus.jsonl, queries.jsonl, qrels/test.tsv
    evaluate(q_vecs, d_vecs, task.qrels, query_groups=task.query_length, doc_groups=task.doc_length)

Synthetic tasks follow LongEmbed (Zhu et al., 2024): for each context length (in tokens of the
tokenizer passed in, counted as ``len(tok(text, add_special_tokens=False).input_ids)``) there are
``docs_per_length`` documents (default 100), each holding exactly one fact about its own person,
and ``queries_per_length`` queries (default 50), each asking about one of those documents; the
candidates of a query are the documents of its length (pass the groups to `retrieval.search`).

* passkey: the filler "The grass is green. The sky is blue. ..." repeated, with "The pass key for
  <First Last> is <5-digit key>. Remember it." at a uniformly random sentence boundary; the query
  is "What is the pass key for <First Last>?". Names and keys are distinct within a length.
* needle: a window of real English prose (`dice_fast.data.prose`, prose paragraphs of the
  Python Language Reference, PSF License; see dice_fast/data/README.md) starting at a random sentence, with
  one fact sentence such as "The secret ingredient in <First Last>'s famous soup is smoked
  paprika." at a random sentence boundary; the query asks for that fact. Names are distinct within
  a length, so each query has exactly one answering document.

Lengths are hit exactly for tokenizers whose counts add up over whitespace-separated words
(WordPiece, e.g. BERT) and to within a few tokens otherwise: the haystack source is tokenized once
with offsets (`_haystack`), each document is cut from it at word boundaries by token count, every document is
measured once and the ones that missed are re-cut once. Output depends only on the seed, the
lengths/counts and the tokenizer; each length draws from its own generator, so a task built for a
subset of lengths holds the same documents for those lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError, MissingFile
from ..textio import check_unicode, read_json_objects, read_lines, record_id, record_text
from ._haystack import PASSKEY_FILLER, count_tokens, haystack

__all__ = ["CONTEXT_LENGTHS", "PASSKEY_FILLER", "Task", "make_passkey_task", "make_needle_task", "load_local_task"]

CONTEXT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

_FIRST_NAMES = (
    "Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hector", "Ingrid", "Jonas",
    "Keiko", "Lorenzo", "Marisol", "Nikolai", "Odette", "Pablo", "Quentin", "Rosalind", "Soren",
    "Tamsin", "Ulrich", "Valentina", "Wendell", "Ximena", "Yusuf", "Zelda", "Anouk", "Bartholomew",
    "Cosima", "Desmond", "Esperanza", "Florian", "Gwendolyn", "Horatio", "Isolde", "Jasper",
    "Kasimir", "Leonora", "Magnus", "Niamh", "Oswald", "Philippa", "Rupert", "Saoirse", "Thaddeus",
    "Ursula", "Vikram", "Winifred",
)
_LAST_NAMES = (
    "Abernathy", "Blackwood", "Castellano", "Delacroix", "Eriksen", "Fairweather", "Grimaldi",
    "Hargreaves", "Iglesias", "Jankowski", "Kowalczyk", "Lindqvist", "Montgomery", "Nakamura",
    "Okonkwo", "Pemberton", "Quintero", "Rasmussen", "Santangelo", "Thorne", "Underwood",
    "Vasquez", "Whitlock", "Yamamoto", "Zielinski", "Ashcroft", "Bellweather", "Carrington",
    "Dunmore", "Everhart", "Fitzgerald", "Galbraith", "Holloway", "Ivanova", "Kingsley",
    "Lockhart", "Marchetti", "Northcott", "Oyelaran", "Pickering", "Radcliffe", "Silverstein",
    "Trevelyan", "Vandermeer", "Wainwright", "Ellsworth", "Halvorsen", "Moreau",
)
# (fact, question, values): exactly one of these is hidden in each needle document
_NEEDLES = (
    ("The secret ingredient in {name}'s famous soup is {value}.",
     "What is the secret ingredient in {name}'s famous soup?",
     ("smoked paprika", "a spoonful of honey", "roasted chestnuts", "fresh tarragon", "dried porcini mushrooms",
      "a splash of cider vinegar", "toasted fennel seeds", "preserved lemon", "black garlic", "saffron threads")),
    ("{name}'s first pet was {value}.",
     "What was {name}'s first pet?",
     ("a grey parrot called Biscuit", "a tortoise called Admiral", "a ferret called Noodle",
      "a goldfish called Captain", "a hedgehog called Bramble", "a rabbit called Pepper",
      "a corn snake called Ziggy", "a beagle called Marmalade")),
    ("{name} hid the spare key to the boathouse {value}.",
     "Where did {name} hide the spare key to the boathouse?",
     ("under a blue flowerpot", "inside an old rubber boot", "behind the loose brick by the door",
      "in a tin of fishing hooks", "beneath the third floorboard", "taped under the workbench")),
    ("The best thing to do in {name}'s home town is {value}.",
     "What is the best thing to do in {name}'s home town?",
     ("to watch the sunset from the old lighthouse", "to eat pastries at the harbour market",
      "to swim in the quarry lake", "to hike up to the ruined chapel", "to hear the brass band on Sundays",
      "to cycle along the canal towpath")),
    ("{name}'s favourite painting shows {value}.",
     "What does {name}'s favourite painting show?",
     ("a fox sleeping in the snow", "three fishing boats at dawn", "a lemon tree in a courtyard",
      "a storm over a wheat field", "an owl perched on a lantern", "a dancer in a red dress")),
    ("The password to {name}'s old diary was {value}.",
     "What was the password to {name}'s old diary?",
     ("marmalade", "thunderclap", "periwinkle", "lighthouse", "buttercup", "kaleidoscope", "moonbeam")),
    ("Every winter {name} grows {value} on the kitchen windowsill.",
     "What does {name} grow on the kitchen windowsill every winter?",
     ("purple basil", "tiny chilli peppers", "hyacinth bulbs", "wheatgrass", "dwarf tomatoes", "paperwhite narcissus")),
    ("{name} learned to juggle from {value}.",
     "Who taught {name} to juggle?",
     ("a retired circus clown", "an uncle who sold umbrellas", "a street performer in Lisbon",
      "the village baker", "a librarian with a red scarf")),
    ("The song {name} always hums while cooking is {value}.",
     "What song does {name} always hum while cooking?",
     ("an old sea shanty about whales", "a lullaby from the mountains", "a jazz tune called Blue Kettle",
      "a march played by the town band", "a folk song about a silver river")),
    ("{name}'s bicycle is painted {value}.",
     "What colour is {name}'s bicycle painted?",
     ("bright orange with white stripes", "emerald green with gold spokes", "sky blue with yellow polka dots",
      "deep purple with silver stars", "cherry red with a black saddle")),
    ("On rainy afternoons {name} likes to {value}.",
     "What does {name} like to do on rainy afternoons?",
     ("build ships in bottles", "bake cinnamon rolls", "sketch pigeons from the window",
      "practise the accordion", "solve crossword puzzles in ink")),
    ("The lucky charm that {name} carries everywhere is {value}.",
     "What lucky charm does {name} carry everywhere?",
     ("a brass button from a sailor's coat", "a smooth green sea glass", "a tiny wooden elephant",
      "a four-leaf clover pressed in resin", "a silver thimble")),
)
_KIND_CODE = {"passkey": 1, "needle": 2}


@dataclass(frozen=True)
class Task:
    """A retrieval task over ``n_docs`` documents and ``n_q`` queries.

    queries: n_q strings; corpus: n_docs strings; qrels: n_q dicts ``{doc_index: relevance}``;
    query_length: (n_q,) int64 and doc_length: (n_docs,) int64 context-length group (tokens) of each
    query / document (all 0 for a local task: one group); query_ids / doc_ids: string ids;
    doc_tokens: (n_docs,) int64 measured token counts of synthetic documents, None for local tasks.
    fact_span / answer_span: (n_docs, 2) int64 character spans ``[start, end)`` in each synthetic
    document of the planted sentence ("The pass key for ... Remember it.") and of its answer (the
    5-digit key; the needle's value, e.g. "smoked paprika"); None for local tasks.
    """

    name: str
    queries: list[str]
    corpus: list[str]
    qrels: list[dict[int, int]]
    query_length: np.ndarray
    doc_length: np.ndarray
    query_ids: list[str]
    doc_ids: list[str]
    doc_tokens: np.ndarray | None = None
    fact_span: np.ndarray | None = None
    answer_span: np.ndarray | None = None

    def gold_document(self) -> np.ndarray:
        """(n_q,) int64: each query's most relevant document (lowest index on ties), -1 if it has none."""
        out = np.full(len(self.qrels), -1, np.int64)
        for i, qr in enumerate(self.qrels):
            pos = [(-r, j) for j, r in qr.items() if r > 0]
            if pos:
                out[i] = min(pos)[1]
        return out


def make_passkey_task(tokenizer, lengths: Sequence[int] = CONTEXT_LENGTHS, docs_per_length: int = 100,
                      queries_per_length: int = 50, seed: int = 0) -> Task:
    """LongEmbed-style passkey retrieval; lengths in tokens of ``tokenizer`` (a fast HF tokenizer)."""
    return _make_synthetic("passkey", tokenizer, lengths, docs_per_length, queries_per_length, seed)


def make_needle_task(tokenizer, lengths: Sequence[int] = CONTEXT_LENGTHS, docs_per_length: int = 100,
                     queries_per_length: int = 50, seed: int = 0) -> Task:
    """LongEmbed-style needle retrieval in real prose; lengths in tokens of ``tokenizer`` (a fast HF tokenizer)."""
    return _make_synthetic("needle", tokenizer, lengths, docs_per_length, queries_per_length, seed)


# ------------------------------------------------------------------------------------------------
# synthetic tasks
# ------------------------------------------------------------------------------------------------
def _check_args(lengths, docs_per_length, queries_per_length, seed) -> list[int]:
    lengths = [int(v) for v in lengths]
    if not lengths or any(v < 16 for v in lengths) or len(set(lengths)) != len(lengths):
        raise ValueError(f"lengths must be distinct token counts >= 16, got {lengths}")
    if not 1 <= queries_per_length <= docs_per_length:
        raise ValueError(f"need 1 <= queries_per_length ({queries_per_length}) <= docs_per_length ({docs_per_length})")
    if docs_per_length > len(_FIRST_NAMES) * len(_LAST_NAMES):
        raise ValueError(f"docs_per_length must be <= {len(_FIRST_NAMES) * len(_LAST_NAMES)} (distinct names)")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return lengths


def _make_synthetic(kind, tokenizer, lengths, docs_per_length, queries_per_length, seed) -> Task:
    lengths = _check_args(lengths, docs_per_length, queries_per_length, seed)
    src, first_copy_sents = haystack(kind, tokenizer, max(lengths))

    corpus, doc_ids, doc_len, doc_tokens, fact_spans, answer_spans = [], [], [], [], [], []
    queries, query_ids, query_len, qrels = [], [], [], []
    n_names = len(_FIRST_NAMES) * len(_LAST_NAMES)
    for length in lengths:
        rng = np.random.default_rng([int(seed), _KIND_CODE[kind], length])
        name_ix = rng.choice(n_names, docs_per_length, replace=False)
        names = [f"{_FIRST_NAMES[i // len(_LAST_NAMES)]} {_LAST_NAMES[i % len(_LAST_NAMES)]}" for i in name_ix]
        if kind == "passkey":
            keys = rng.choice(90000, docs_per_length, replace=False) + 10000
            facts = [f"The pass key for {nm} is {k}. Remember it." for nm, k in zip(names, keys)]
            questions = [f"What is the pass key for {nm}?" for nm in names]
            answers = [(len(f"The pass key for {nm} is "), len(str(k))) for nm, k in zip(names, keys)]
        else:
            tpl = rng.integers(len(_NEEDLES), size=docs_per_length)
            val = rng.random(docs_per_length)
            facts, questions, answers = [], [], []
            for nm, t, v in zip(names, tpl, val):
                fact, question, values = _NEEDLES[t]
                value = values[int(v * len(values))]
                facts.append(fact.format(name=nm, value=value))
                questions.append(question.format(name=nm))
                answers.append((len(fact.split("{value}")[0].format(name=nm)), len(value)))
        starts = rng.choice(first_copy_sents, docs_per_length)
        depths = rng.random(docs_per_length)
        asked = np.sort(rng.choice(docs_per_length, queries_per_length, replace=False))

        needle_tokens = count_tokens(tokenizer, facts)
        budgets = length - needle_tokens
        if np.any(budgets < 8):
            raise ValueError(f"length {length} is too short for the {kind} sentences ({needle_tokens.max()} tokens)")
        built = [src.build(*src.window(int(s), int(b)), f, float(d))
                 for s, b, f, d in zip(starts, budgets, facts, depths)]
        docs, at = [t for t, _ in built], [a for _, a in built]
        counts = count_tokens(tokenizer, docs)
        miss = np.flatnonzero(counts != length)
        if miss.size:  # one correction pass: tokenizers whose counts do not add up over words
            redo = [src.build(*src.window(int(starts[j]), int(budgets[j] + length - counts[j])),
                              facts[j], float(depths[j])) for j in miss]
            recount = count_tokens(tokenizer, [t for t, _ in redo])
            for j, (text, a), c in zip(miss, redo, recount):
                if abs(c - length) < abs(counts[j] - length):
                    docs[j], at[j], counts[j] = text, a, c
        fact_spans.append(np.array([(a, a + len(f)) for a, f in zip(at, facts)], np.int64).reshape(-1, 2))
        answer_spans.append(np.array([(a + o, a + o + n) for a, (o, n) in zip(at, answers)], np.int64).reshape(-1, 2))

        base = len(corpus)
        corpus += docs
        doc_ids += [f"{kind}-{length}-{j:04d}" for j in range(docs_per_length)]
        doc_len += [length] * docs_per_length
        doc_tokens.append(counts)
        for q, j in enumerate(asked):
            queries.append(questions[j])
            query_ids.append(f"{kind}-{length}-q{q:04d}")
            query_len.append(length)
            qrels.append({base + int(j): 1})
    return Task(
        name=kind, queries=queries, corpus=corpus, qrels=qrels,
        query_length=np.array(query_len, np.int64), doc_length=np.array(doc_len, np.int64),
        query_ids=query_ids, doc_ids=doc_ids, doc_tokens=np.concatenate(doc_tokens).astype(np.int64),
        fact_span=np.concatenate(fact_spans), answer_span=np.concatenate(answer_spans),
    )


# ------------------------------------------------------------------------------------------------
# local BEIR folders
# ------------------------------------------------------------------------------------------------
def load_local_task(path, split: str = "test", name: str | None = None) -> Task:
    """Load a BEIR-layout folder: ``corpus.jsonl`` (``_id``, optional ``title``, ``text``),
    ``queries.jsonl`` (``_id``, ``text``) and ``qrels/<split>.tsv`` (``query-id<TAB>corpus-id<TAB>score``,
    header optional).

    As in BEIR, only queries that appear in the qrels are kept (in queries.jsonl order) and a
    document's text is ``title + " " + text`` when it has a title. Files are read as ``dice-fast encode``
    reads its inputs (`dice_fast.textio`): UTF-8, a byte order mark on the first line dropped, lines
    ending at ``\n`` (a ``\r`` before it dropped, a lone ``\r`` is no line break). An ``_id`` is a
    string or an integer, taken as it is (a float, a bool, a null is refused; nothing is stripped), and
    the qrels ids are the tab-separated fields as they are, compared exactly. Relevance scores must be
    integers; 0 means judged not relevant. Raises `MissingFile` (a FileNotFoundError) for a missing
    file and `InputError` (a ValueError) naming the file and line for bytes that are not UTF-8,
    malformed JSON, missing fields, ids or texts that are not valid Unicode, duplicate ids, bad qrels
    rows and ids that are not in the corpus / queries.
    """
    root = Path(path)
    if not root.is_dir():
        raise MissingFile(f"{root}: not a directory (expected corpus.jsonl, queries.jsonl, qrels/{split}.tsv)")
    corpus_path, queries_path, qrels_path = root / "corpus.jsonl", root / "queries.jsonl", root / "qrels" / f"{split}.tsv"
    for p in (corpus_path, queries_path, qrels_path):
        if not p.is_file():
            raise MissingFile(f"{p}: missing (BEIR layout: corpus.jsonl, queries.jsonl, qrels/{split}.tsv)")

    doc_ids, corpus, doc_where = [], [], []
    for where, doc_id, text, rec in _read_jsonl(corpus_path):
        title = rec.get("title")
        if title is None:
            title = ""
        elif not isinstance(title, str):
            raise InputError(f"{where}: field 'title' is {type(title).__name__}, expected a string")
        check_unicode(title, where, "field 'title'")
        doc_ids.append(doc_id)
        doc_where.append(where)
        corpus.append(f"{title} {text}" if title.strip() else text)
    doc_index = _index(doc_ids, doc_where)

    all_qids, all_queries, query_where = [], [], []
    for where, qid, text, _ in _read_jsonl(queries_path):
        all_qids.append(qid)
        all_queries.append(text)
        query_where.append(where)
    query_index = _index(all_qids, query_where)

    judged: dict[int, dict[int, int]] = {}
    for lineno, (where, line) in enumerate(read_lines(qrels_path), 1):
        if not line.strip():
            continue
        cols = line.split("\t")
        if len(cols) != 3:
            lone_cr = " (it holds a carriage return: lines end at \\n only)" if "\r" in line else ""
            raise InputError(f"{where}: expected 3 tab-separated columns (query-id, corpus-id, score), "
                             f"got {len(cols)}{lone_cr}")
        qid, did, score = cols
        try:
            rel = int(score)
        except ValueError:
            if lineno == 1 and not judged:
                continue  # header line
            raise InputError(f"{where}: score {score!r} is not an integer") from None
        for value, ids, what, file in ((qid, query_index, "query-id", queries_path.name),
                                       (did, doc_index, "corpus-id", corpus_path.name)):
            if value not in ids:
                hint = f" ({file} has {value.strip()!r}: ids are compared exactly)" if value.strip() in ids else ""
                raise InputError(f"{where}: {what} {value!r} is not in {file}{hint}")
        judged.setdefault(query_index[qid], {})[doc_index[did]] = rel
    if not judged:
        raise InputError(f"{qrels_path}: no relevance judgements")

    keep = sorted(judged)
    return Task(
        name=name or root.name,
        queries=[all_queries[i] for i in keep],
        corpus=corpus,
        qrels=[judged[i] for i in keep],
        query_length=np.zeros(len(keep), np.int64),
        doc_length=np.zeros(len(corpus), np.int64),
        query_ids=[all_qids[i] for i in keep],
        doc_ids=doc_ids,
        doc_tokens=None,
    )


def _read_jsonl(path: Path):
    """Yield ("file:line", id, text, record): ``_id`` and ``text`` read as ``dice-fast encode`` reads an id
    and a text (`record_id`, `record_text`); `InputError` naming the file and line otherwise."""
    for where, rec in read_json_objects(path):
        yield where, record_id(rec, "_id", where), record_text(rec, "text", where), rec


def _index(ids: list[str], wheres: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, x in enumerate(ids):
        if x in out:
            raise InputError(f"{wheres[i]}: duplicate _id {x!r} (first at line {wheres[out[x]].rsplit(':', 1)[1]})")
        out[x] = i
    return out
