"""The ``dice-fast`` command: a root that registers each subpackage's subcommands and nothing else.

Each subcommand's arguments live next to the code it runs (``register_cli(subparsers)`` in
``dice_fast/<subpackage>/cli.py``); registering loads no model and imports no optional extra.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import select
import signal
import sys
import threading

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
        epilog="exit status: 0 done; 2 an error (one line on stderr) or an interruption (Ctrl-C or SIGTERM: "
        "the command's clean-up runs); 1 a bug (with its traceback), or bench --require-packed found the "
        "padded path; 141 the reader of the output went away (| head); serve: 0 after a drain, 3 when its "
        "encoder stopped (a failed warm-up).",
    )
    parser.add_argument("--version", action="version", version=f"dice-fast {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. A user's error (a bad option, input, model or cache, out of memory) is
    printed as one ``dice-fast: error:`` line, by its type (`dice_fast.errors.describe`), with exit
    status 2, and so are Ctrl-C and SIGTERM wherever they land (a corpus job's own handling says more;
    the server drains and exits 0); output whose reader went away ends quietly with status 141;
    anything else is a bug and raises with its traceback."""
    args = build_parser().parse_args(argv)
    signals = []
    try:
        with _sigterm_as_ctrl_c(signals):
            return args.func(args)
    except KeyboardInterrupt:
        print(f"dice-fast: error: interrupted ({signals[-1] if signals else 'Ctrl-C'}) during {args.command}",
              file=sys.stderr)
        return 2
    except Exception as exc:
        from .errors import describe

        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            # the reader of the output went away (`dice-fast search ... | head -1`): no one to tell; the status
            # of a process SIGPIPE would have ended, and no second error when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        message = describe(exc)
        if message is None:
            raise
        print(f"dice-fast: error: {message}", file=sys.stderr)
        return 2


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no file descriptor (a captured stdout)
        return False


@contextlib.contextmanager
def _sigterm_as_ctrl_c(seen: list):
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so that a command's clean-up runs (Python's own
    SIGTERM ends the process at once: no ``finally``, no message); ``seen`` gets "SIGTERM". A command
    with handlers of its own (a corpus job, the server) sets them over this one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        seen.append("SIGTERM")
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
