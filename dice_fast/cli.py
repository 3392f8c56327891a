"""The ``dice-fast`` command: a root that registers each subpackage's subcommands and nothing else.

Each subcommand's arguments live next to the code it runs (``register_cli(subparsers)`` in
``dice_fast/<subpackage>/cli.py``); registering loads no model and imports no optional extra.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

SUBCOMMAND_MODULES = (
    "dice_fast.corpus.cli",  # encode
    "dice_fast.eval.cli",  # eval
    "dice_fast.bench.cli",  # bench
    "dice_fast.serve.cli",  # serve, bench-serve
    "dice_fast.index.cli",  # index, search
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dice-fast",
        description="Exact, packed DICE embeddings of long documents: every document is split into token "
        "chunks, each chunk is encoded on its own by a frozen Hugging Face model (positions restarting per "
        "chunk), and chunk vectors are aggregated into one vector per document.",
    )
    parser.add_argument("--version", action="version", version=f"dice-fast {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. A user's error (a bad option, input, model or cache, out of memory) is
    printed as one ``dice-fast: error:`` line, by its type (`dice_fast.errors.describe`), with exit
    status 2, and so is Ctrl-C wherever it lands (a corpus job's own handling says more); anything
    else is a bug and raises with its traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"dice-fast: error: interrupted (Ctrl-C) during {args.command}", file=sys.stderr)
        return 2
    except Exception as exc:
        from .errors import describe

        message = describe(exc)
        if message is None:
            raise
        print(f"dice-fast: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
