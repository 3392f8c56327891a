"""``dice-fast encode INPUT -o OUTPUT``: encode a corpus (or queries) into vectors, streaming.

Argument parsing and error reporting only; the job itself is `dice_fast.corpus.job.EncodeJob`.
Registering the subcommand imports neither torch, transformers nor pyarrow.
"""

from __future__ import annotations

import argparse

from ..cliargs import add_cache_arguments, add_encoder_arguments

EPILOG = """\
input:
  .txt      one document per line; id = line number (1-based; --id-field is refused)
  .jsonl    one JSON object per line (.ndjson too); text in --field; id = --id-field, else the line number
  .gz .bz2 .xz after .txt or .jsonl (corpus.jsonl.gz): read decompressed, as a stream
  .parquet  text in column --field; id = column --id-field, else the row number (1-based); read in batches
  DIR       every .txt/.jsonl/.ndjson/.parquet file below DIR (sorted by path; hidden files and earlier
            encode outputs skipped); line/row-number ids become "relative/path.txt:LINE"
  -         stdin; needs --format txt or --format jsonl
  Blank lines (empty or whitespace only) are skipped in .txt and .jsonl alike and counted in the summary;
  line numbers still count them, so an id always names its line. Ids are written as strings.

output (-o):
  OUT.npy      float32 (rows, dim), row i = i-th document; ids in OUT.ids.txt beside it (line i+2, after a
               line recording the .npy's rows and sha256; the ids file is renamed last, and load_embeddings
               refuses a pair that does not match)
  OUT.parquet  columns id (string) and embedding (fixed-size list of float32); options in the metadata
  DIR/         Parquet shards part-00000.parquet ... of --shard-rows rows and manifest.json, committed
               shard by shard as each window of documents is encoded (--max-batch-tokens x 64
               characters; see docs/corpus.md) (a path without extension is a folder too)
  --chunks     Parquet outputs also get chunk_embeddings, chunk_start_char, chunk_end_char and
               chunk_tokens (one list per row); refused with .npy and --queries
  Files appear only when complete (written to hidden temporary names, fsynced, renamed). An existing
  output is refused unless --overwrite, which removes it only once the new job completes (a failed or
  interrupted one leaves it as it was). A running job locks its output (a hidden .dice-fast*.lock file
  held with flock, released by the kernel even on kill -9): a second job on the same file, on the same
  folder, or on a conflicting split of it (an unsplit job, or another split count) is refused.

resume and splits (folder output):
  --resume      continue an interrupted job (Ctrl-C, SIGTERM or kill -9) after its last committed shard;
                refused, saying what differs, when the options or the input changed. With no manifest
                yet it starts afresh.
  --shard I/N   encode documents I, I+N, I+2N ... only; files are named part-IofN-*.parquet and
                manifest-IofN.json, so N processes can share one folder (load_embeddings reads the
                N splits back in input order).

exit status: 0 done; 2 a usage or input error, the output locked by a running job (the line names its pid,
host, start time and command), or interrupted by Ctrl-C / SIGTERM (one line on stderr;
temporary files removed, committed shards kept). Vectors equal an uninterrupted run's to float rounding.
"""


def register_cli(subparsers) -> None:
    """Add the ``encode`` subcommand."""
    enc = subparsers.add_parser(
        "encode", help="encode documents or queries into .npy, .parquet or Parquet shards (resumable)",
        description="Encode every document (or query, with --queries) of INPUT into one vector, streaming: memory "
        "does not grow with the corpus. The progress bar counts tokens; its ETA is estimated from the input's "
        "size in bytes.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    enc.add_argument("input", help="a .txt, .jsonl/.ndjson (either may end in .gz, .bz2 or .xz) or .parquet file, "
                                   "a folder of them, or - for stdin")
    enc.add_argument("--output", "-o", required=True, help="OUT.npy, OUT.parquet, or DIR/ for Parquet shards")
    enc.add_argument("--format", choices=("auto", "txt", "jsonl", "parquet"), default="auto",
                     help="input type (default: by extension); for a folder, read only files of this type; "
                     "required for stdin")
    enc.add_argument("--field", "--text-field", "--text-column", dest="field", default="text",
                     help='the JSON field or Parquet column holding the text (default "text")')
    enc.add_argument("--id-field", "--id-column", dest="id_field", default=None,
                     help="the JSON field or Parquet column holding the id (default: line or row number)")
    enc.add_argument("--queries", action="store_true",
                     help="encode as queries (one model window each, never chunked; --query-prefix applies)")
    enc.add_argument("--overwrite", action="store_true", help="replace an existing output")
    enc.add_argument("--resume", action="store_true",
                     help="continue an interrupted job into the same folder from its last committed shard")
    enc.add_argument("--shard", metavar="I/N", default=None,
                     help="encode only split I of N (documents I, I+N, ...), e.g. --shard 0/4")
    enc.add_argument("--shard-rows", type=int, default=10_000, metavar="N",
                     help="rows per Parquet shard of a folder output (default 10000)")
    enc.add_argument("--chunks", action="store_true",
                     help="also write each document's chunk vectors, character spans and token counts (Parquet "
                     "outputs only), so `dice-fast index OUTPUT` or DiceIndex.from_corpus can index them")
    enc.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    add_encoder_arguments(enc)
    add_cache_arguments(enc)
    enc.set_defaults(func=cmd_encode)


def cmd_encode(args) -> int:
    """Run the job; a foreseeable failure raises, and `dice_fast.cli.main` prints it as one
    ``dice-fast: error:`` line with exit status 2 (`dice_fast.errors.describe`)."""
    if args.quiet:
        _quiet_transformers()
    from .job import EncodeJob

    return EncodeJob(args).run()


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging

        logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
