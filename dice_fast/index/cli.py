"""``dice-fast index INPUT -o INDEX`` builds a `DiceIndex`; ``dice-fast index push OUT --to URL`` writes a
corpus job's output into Qdrant or LanceDB; ``dice-fast search INDEX|URL "query"`` asks either.

Registering the subcommands imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterator

from ..cliargs import add_encoder_arguments, encoder_flags_given
from ..errors import InputError, OptionError
from ..scoring import SCORINGS
from .common import DEFAULT_SCORING
from .remote import DEFAULT_BATCH

EPILOG = """\
input (one document per line or record):
  .txt      one document per line (blank lines skipped); id = line number (1-based)
  .jsonl    one JSON object per line; text in --field, id in --id-field (default: the line number)
  .parquet / DIR   the output of `dice-fast encode ... --chunks` (vectors already made, no model run;
            it holds no texts, so search prints character spans; the model options come from it,
            and a model or option flag beside it is refused: it would change nothing)

push (write a corpus job's output into a vector database, shard by shard):
  dice-fast index push OUT --to qdrant://HOST:PORT/COLLECTION | qdrant+path://DIR/COLLECTION
                              | lancedb://DIR/TABLE  [--resume]
  OUT is an `encode --chunks` output; writes replace documents by id; into a store that already
  holds documents only with --resume, which skips shards stored as they are (a killed push resumes; a
  re-encoded corpus updates the documents that changed).

The index is a folder: vectors, spans, ids and texts (one UTF-8 blob) in files of one generation,
named by index.json (docs/retrieval.md). Texts are stored by default so `dice-fast search` can print
the evidence passage; --no-store-text keeps only the spans (search then prints the character span
instead of the text). An existing index is refused unless --overwrite, which replaces it whole
(atomically: readers see the old or the new one). A .txt / .jsonl input is read twice: every record
checked first (only the ids kept), then the texts streamed into the model a window at a time.
"""


def register_cli(subparsers) -> None:
    """Add the ``index`` and ``search`` subcommands."""
    build = subparsers.add_parser(
        "index", help="build a searchable index (document vectors, chunk vectors and spans) from texts",
        description="Encode every document of INPUT with its chunk vectors and character spans into an index "
        "folder that `dice-fast search` ranks by document and reads by chunk.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    build.add_argument("input", nargs="+", metavar="INPUT",
                       help="a .txt (one document per line) or .jsonl file, or an encode --chunks output; "
                       "or: push OUT (with --to)")
    build.add_argument("--output", "-o", help="the index folder to write (required unless push)")
    build.add_argument("--overwrite", action="store_true", help="replace an existing index (refused without it)")
    build.add_argument("--field", default="text", help='JSON field holding the text (default "text")')
    build.add_argument("--id-field", default=None, help="JSON field holding the id (default: the line number)")
    build.add_argument("--store-text", action=argparse.BooleanOptionalAction, default=None,
                       help="keep the texts in the index so search prints the passage (default: yes)")
    build.add_argument("--chunk-dtype", choices=("float32", "float16"), default="float32",
                       help="storage of chunk vectors (default float32; float16 halves them, scores within about 1e-3)")
    pushing = build.add_argument_group("push OUT --to URL")
    pushing.add_argument("--to", metavar="URL", help="the store: qdrant://HOST:PORT/COLLECTION, "
                         "qdrant+path://DIR/COLLECTION or lancedb://DIR/TABLE")
    pushing.add_argument("--resume", action="store_true",
                         help="continue (or update) a push: skip the row groups (4,096 documents) stored as they "
                         "are, write the others")
    pushing.add_argument("--batch-size", type=int, default=None, help=f"documents per write (default {DEFAULT_BATCH})")
    pushing.add_argument("--quiet", action="store_true", help="no progress bar")
    add_encoder_arguments(build)
    build.set_defaults(func=_build)

    search = subparsers.add_parser(
        "search", help="rank an index's documents for a query and print each hit's evidence passage",
        description="Print, per hit: rank, id, score and the evidence passage (the chunk that matched best).")
    search.add_argument("index", help="an index folder written by `dice-fast index`, or a store URL "
                        "(qdrant://..., qdrant+path://..., lancedb://...)")
    search.add_argument("query", nargs="+", help="one or more queries")
    search.add_argument("-k", type=int, default=5, help="hits per query (default 5)")
    search.add_argument("--scoring", choices=SCORINGS, default=DEFAULT_SCORING,
                        help=f"maxsim: best chunk; dice: document vector; hybrid: a blend (default {DEFAULT_SCORING}, "
                        "the measured best: docs/retrieval.md)")
    search.add_argument("--alpha", type=float, default=None, help="hybrid weight of the dice score (default 0: the "
                        "measured best, docs/retrieval.md)")
    search.add_argument("--device", default=None, help="where the query encoder runs (default: cuda if available)")
    search.add_argument("--json", action="store_true", help="one JSON object per hit instead of text")
    search.set_defaults(func=_search)


def _build(args) -> int:
    from pathlib import Path

    from ..cliargs import make_encoder
    from . import DiceIndex
    from .folder import check_destination

    if args.input[0] == "push":
        return _push(args)
    if len(args.input) != 1 or args.to is not None or args.resume:
        raise OptionError("give one INPUT with -o, or: dice-fast index push OUT --to URL [--resume]")
    if args.output is None:
        raise OptionError("-o/--output (the index folder to write) is required")
    if (Path(args.output) / "index.json").exists() and not args.overwrite:  # before any model loads
        raise OptionError(f"{args.output} already holds an index; pass --overwrite to replace it")
    check_destination(args.output)  # a file, a foreign or unwritable folder: before the corpus is encoded
    args.input = args.input[0]
    if Path(args.input).is_dir() or Path(args.input).suffix.lower() == ".parquet":
        _refuse_encoding_flags(args)
        index = DiceIndex.from_corpus(args.input, chunk_dtype=args.chunk_dtype)
    else:
        ids = _checked_ids(args.input, args.field, args.id_field)  # every record, before any model loads
        if not ids:
            raise InputError(f"{args.input}: no documents")
        texts = (text for _, _, text in _records(args.input, args.field, args.id_field))  # read again, streamed
        index = DiceIndex.from_texts(make_encoder(args), texts, ids, store_text=args.store_text is not False,
                                     chunk_dtype=args.chunk_dtype)
    index.save(args.output)
    print(f"{args.output}: {len(index)} documents, {index.n_chunks} chunks, {index.nbytes / 2**20:.1f} MiB of vectors",
          file=sys.stderr)
    return 0


def _refuse_encoding_flags(args) -> None:
    """An encode --chunks output is indexed as it was encoded: a model or option flag beside it changed
    nothing, silently (``--chunk-size 64 --model /no/such/folder`` built an index of chunk size 8)."""
    texts = (("--field", args.field, "text"), ("--id-field", args.id_field, None),
             ("--[no-]store-text", args.store_text, None))
    given = encoder_flags_given(args) + [flag for flag, value, default in texts if value != default]
    if given:
        them = "it" if len(given) == 1 else "them"
        raise OptionError(f"{args.input} is an encode --chunks output, indexed with the model and options it was "
                          f"encoded with (and without texts): {', '.join(given)} would change nothing; drop "
                          f"{them}, or encode the texts again with {them}")


def _push(args) -> int:
    from .corpus_output import corpus_files
    from .push import push, store_for_output

    if len(args.input) != 2 or args.to is None or args.output is not None or args.overwrite:
        raise OptionError("usage: dice-fast index push OUT --to URL [--resume] (OUT: an encode --chunks output)")
    out = args.input[1]
    files = corpus_files(out)  # every shard checked before the store is opened (or created)
    with store_for_output(args.to, out, args.batch_size) as store:
        done = push(out, store, resume=args.resume, progress=not args.quiet, files=files)
        print(f"{args.to}: wrote {done['documents']} documents, skipped {done['skipped']} already stored "
              f"({done['shards']} shards); it holds {len(store)}", file=sys.stderr)
    return 0


def _search(args) -> int:
    import json

    from ..scoring import DEFAULT_ALPHA
    from . import DiceIndex

    if args.k < 1:
        raise OptionError(f"-k must be at least 1, got {args.k}")
    if args.alpha is not None and args.scoring != "hybrid":  # it weighs nothing else
        raise OptionError(f"--alpha weighs the hybrid scoring; pass --scoring hybrid (got --scoring {args.scoring})")
    from .stores import SCHEMES, open_store

    alpha = DEFAULT_ALPHA if args.alpha is None else args.alpha
    if args.index.startswith(SCHEMES):  # the recorded model and options encode the queries
        with open_store(args.index, create=False) as store:  # a typo creates nothing; the client closed after
            store.attach_encoder(None, device=args.device, where=store.where)
            results = store.search(args.query, args.k, args.scoring, alpha=alpha)
    else:
        results = DiceIndex.load(args.index, device=args.device).search(args.query, args.k, args.scoring, alpha=alpha)
    for query, hits in zip(args.query, results):
        if not args.json:
            print(f"query: {query}")
        for rank, h in enumerate(hits, 1):
            if args.json:  # a document without chunks (an empty text, a dice hit) has no chunk score: null, not -Infinity
                hit = {**h.__dict__, "chunk_score": h.chunk_score if h.chunk >= 0 else None}
                print(json.dumps({"query": query, "rank": rank, **hit}, ensure_ascii=False, allow_nan=False))
                continue
            if h.chunk < 0:
                print(f"{rank:>3}  {h.id}  {h.score:.4f}  no chunks (an empty text)")
                continue
            passage = " ".join(h.text.split()) if h.text is not None else f"[characters {h.start_char}:{h.end_char}]"
            print(f"{rank:>3}  {h.id}  {h.score:.4f}  chunk {h.chunk} ({h.chunk_score:.4f}): {passage}")
    return 0


def _checked_ids(path: str, field: str, id_field: str | None) -> list[str]:
    """The ids of the records of ``path`` (`_records`), every record read and checked, none kept: a
    duplicate id is refused naming the lines of both."""
    from ..errors import InputError

    seen: dict[str, str] = {}
    for where, doc_id, _ in _records(path, field, id_field):
        if (first := seen.setdefault(doc_id, where)) != where:
            raise InputError(f"duplicate id {doc_id!r}: {first} and {where}")
    return list(seen)


def _records(path: str, field: str, id_field: str | None) -> Iterator[tuple[str, str, str]]:
    """(file:line, id, text) of each document of a .txt (one per non-blank line) or .jsonl / .ndjson
    file, either compressed (extensions in any case, as ``dice-fast encode`` reads them), read as they
    are asked for; errors name file:line, and ids are checked as ``dice-fast encode`` checks them (a record without
    the id field, a null or a float id, an id that is not valid Unicode is refused, never replaced)."""
    from ..errors import InputError
    from ..textio import format_suffix, no_id_field_in_lines, read_json_objects, read_lines, record_id, record_text

    suffix = format_suffix(path)
    if suffix in (".jsonl", ".ndjson"):
        for where, record in read_json_objects(path):
            text = record_text(record, field, where)
            yield where, where.rsplit(":", 1)[1] if id_field is None else record_id(record, id_field, where), text
    elif suffix == ".txt":
        if id_field is not None:  # as encode refuses it: a line has no fields
            raise no_id_field_in_lines(f"input {path} is a .txt file", id_field)
        for where, line in read_lines(path):
            if line.strip():
                yield where, where.rsplit(":", 1)[1], line
    else:
        raise InputError(f"{path}: expected a .txt, .jsonl or .ndjson file (or one of them .gz, .bz2 or .xz), or "
                         "an encode --chunks output (.parquet or a folder)")
