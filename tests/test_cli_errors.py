"""The command line reports a user's error as one line, decided by the error's type: a bad ``--model``
reads the same in every subcommand, and out-of-memory is recognised without reading messages."""

from __future__ import annotations

import json

import pytest
import torch

from dice_fast import DiceEncoder, DiceIndex, cli
from dice_fast.errors import CacheError, InputOutOfMemory, MissingDependency, ModelError, OptionError, describe, require
from tiny_models import tiny

BAD = "/nonexistent/dice-model"
EXPECTED = f"dice-fast: error: model {BAD}: no such model folder"


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "docs.txt").write_text("a first document\nand a second one\n")
    return tmp_path


def _index_with_bad_model(tmp_path) -> str:
    model, tok, *_ = tiny("bert")
    index = DiceIndex.from_texts(DiceEncoder(model, tok, chunk_size=8), ["one text", "another text"], ["a", "b"])
    index.save(tmp_path / "idx")
    meta = json.loads((tmp_path / "idx" / "index.json").read_text())
    meta["model"] = BAD
    (tmp_path / "idx" / "index.json").write_text(json.dumps(meta))
    return str(tmp_path / "idx")


SUBCOMMANDS = {
    "encode": lambda d: ["encode", str(d / "docs.txt"), "-o", str(d / "out.npy"), "--model", BAD],
    "eval": lambda d: ["eval", "--model", BAD],
    "bench": lambda d: ["bench", "--csv", str(d / "bench.csv"), "--model", BAD],
    "serve": lambda d: ["serve", "--model", BAD],
    "bench-serve": lambda d: ["bench-serve", "--model", BAD],
    "index": lambda d: ["index", str(d / "docs.txt"), "-o", str(d / "idx"), "--model", BAD],
    "search": lambda d: ["search", _index_with_bad_model(d), "a query"],
}


def test_every_subcommand_is_covered():
    usage = cli.build_parser().format_usage()  # "usage: dice-fast [-h] [--version] {encode,eval,...} ..."
    assert set(usage[usage.index("{") + 1 : usage.index("}")].split(",")) == set(SUBCOMMANDS)


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_a_bad_model_path_reads_the_same_everywhere(command, inputs, capsys):
    assert cli.main(SUBCOMMANDS[command](inputs)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == EXPECTED, err


def test_errors_are_described_by_type_not_text():
    assert describe(ModelError("model x: no such folder", "x")) == "model x: no such folder"
    assert describe(OptionError("overlap must be\n  smaller")) == "overlap must be smaller"
    assert describe(CacheError("not a cache")) == "not a cache"
    oom = InputOutOfMemory(3, 512, "CUDA out of memory", "documents[3]")
    assert describe(oom) == str(oom) and "documents[3]" in describe(oom)
    assert describe(torch.OutOfMemoryError("CUDA out of memory. Tried")).startswith("out of memory (")
    assert describe(MemoryError()).startswith("out of memory (")
    assert describe(RuntimeError("out of memory")) is None  # never by its text: a bug, raised with its traceback
    assert describe(KeyError("x")) is None


def test_a_missing_optional_package_is_named_with_its_extra(tmp_path, monkeypatch):
    """Every optional package goes through `errors.require` (three wrappers before, two of them a plain
    ImportError): the missing ones named with the extra to install; one installed that fails to import
    says so and why; ``load=False`` imports nothing."""
    with pytest.raises(MissingDependency, match=r"^the X needs no_such_a, no_such_b.sub: pip install 'dice-fast\[x\]' \(hint\)$"):
        require("json", "no_such_a", "no_such_b.sub", extra="x", needed_by="the X", hint=" (hint)")
    (tmp_path / "broken_dependency.py").write_text("import no_such_module_inside\n")
    (tmp_path / "not_imported.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingDependency, match="broken_dependency, which is installed but failed to import .*no_such_module_inside"):
        require("broken_dependency", extra="x", needed_by="the X")
    assert require("not_imported", extra="x", needed_by="the X", load=False) is None
    (tmp_path / "broken_package").mkdir()
    (tmp_path / "broken_package" / "__init__.py").write_text("import no_such_module_inside\n")
    (tmp_path / "broken_package" / "sub.py").write_text("")
    with pytest.raises(MissingDependency, match="broken_package.sub, which is installed but failed to import"):
        require("broken_package.sub", extra="x", needed_by="the X")  # it said "pip install": the cause was lost
    assert require("json", "math", extra="x", needed_by="the X") is json
    assert isinstance(MissingDependency("x"), ImportError) and describe(MissingDependency("m")) == "m"


def test_a_model_folder_without_its_tokenizer_is_refused(inputs, capsys):
    """transformers makes up a five-token tokenizer for a folder without one: every word [UNK], two
    unrelated documents at cosine 0.99, exit 0. The folder is refused, naming what it lacks."""
    import shutil

    from dice_fast.models import default_model_path

    folder = inputs / "no_tokenizer"
    shutil.copytree(default_model_path(), folder)
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "special_tokens")):
            f.unlink()
    assert cli.main(["encode", str(inputs / "docs.txt"), "-o", str(inputs / "o.npy"), "--model", str(folder)]) == 2
    assert f"model {folder} has no tokenizer files" in capsys.readouterr().err
    assert not (inputs / "o.npy").exists()


def test_ctrl_c_anywhere_is_one_line_and_exit_2(monkeypatch, capsys):
    """Before a corpus job installs its own handling (the model still loading), Ctrl-C printed a
    KeyboardInterrupt traceback."""
    import argparse

    def interrupted(args):
        raise KeyboardInterrupt

    parsed = argparse.Namespace(command="encode", func=interrupted)
    monkeypatch.setattr(cli, "build_parser", lambda: argparse.Namespace(parse_args=lambda argv: parsed))
    assert cli.main(["encode", "x.txt", "-o", "o.npy"]) == 2
    assert capsys.readouterr().err.strip() == "dice-fast: error: interrupted (Ctrl-C) during encode"


def test_sigterm_is_ctrl_c_for_every_command(monkeypatch, capsys):
    """SIGTERM (a container stopped, a job killed by its scheduler) ended `index`, `search`, `eval` and
    `bench` at once: no message, no ``finally`` (an index save's clean-up skipped)."""
    import argparse
    import os
    import signal
    import time

    cleaned = []

    def terminated(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    parsed = argparse.Namespace(command="index", func=terminated)
    monkeypatch.setattr(cli, "build_parser", lambda: argparse.Namespace(parse_args=lambda argv: parsed))
    assert cli.main(["index", "in.jsonl", "-o", "ix"]) == 2
    assert cleaned == [True] and signal.getsignal(signal.SIGTERM) is before
    assert capsys.readouterr().err.strip() == "dice-fast: error: interrupted (SIGTERM) during index"


def test_output_whose_reader_went_away_ends_quietly(tmp_path):
    """`dice-fast search ... | head -1` printed "dice-fast: error: [Errno 32] Broken pipe" with status 2."""
    import subprocess
    import sys

    script = ("import argparse, sys\n"
              "from dice_fast import cli\n"
              "def many(args):\n"
              "    for i in range(200000):\n"
              "        print(f'line {i}')\n"
              "    return 0\n"
              "parsed = argparse.Namespace(command='search', func=many)\n"
              "cli.build_parser = lambda: argparse.Namespace(parse_args=lambda argv: parsed)\n"
              "sys.exit(cli.main([]))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"line 0\n"
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141
    assert proc.stderr.read() == b""


@pytest.mark.parametrize("argv,flag", [
    (["serve", "--graceful-timeout", "nan"], "--graceful-timeout: must be >= 0"),
    (["serve", "--graceful-timeout", "-5"], "--graceful-timeout: must be >= 0"),
    (["bench", "--longest", "0"], "--longest: must be >= 1"),
    (["bench", "--budget-s", "inf"], "--budget-s: must be > 0"),
    (["bench-serve", "--timeout", "nan"], "--timeout: must be > 0"),
    (["eval", "--check-docs", "-1"], "--check-docs: must be >= 0"),
    (["eval", "--check-docs", "two"], "--check-docs: expected an integer"),
])
def test_out_of_range_numbers_are_refused_naming_the_flag(argv, flag, capsys):
    """nan, inf and negative numbers were accepted (a server that never waits, a bench of empty documents)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_a_finished_jobs_summary_never_fails_the_job(monkeypatch, capsys):
    """`encode` committed its output, then exited 2 when stdout (a full disk, an encoding without a
    path's characters) could not take its summary line; a retry was then refused (the output existed)."""
    import errno
    import io
    import sys

    from dice_fast.progress import print_done

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    print_done("encoded 3 documents -> out.npy")
    assert "done, but stdout could not take the summary (No space left on device)" in capsys.readouterr().err
    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    print_done("-> caf\udcff.npy")
    ascii_out.flush()
    assert ascii_out.buffer.getvalue() == b"-> caf\\udcff.npy\n"

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    with pytest.raises(BrokenPipeError):  # the command line ends quietly with 141, as for `| head`
        print_done("x")


def test_writes_the_os_cuts_short_name_the_file_and_the_cause(tmp_path):
    """Under a file size limit (a full disk's stand-in): numpy's short write said "N requested and M
    written", without a why; the output lock's write raised a bare "[Errno 27] File too large" naming no
    file and left the lock file behind."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import resource
        from pathlib import Path
        import numpy as np
        from dice_fast.corpus.lock import OutputLock
        from dice_fast.errors import WriteError, writing

        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
        try:
            with writing("{tmp_path}/x.npy"), open("{tmp_path}/x.npy", "wb") as f:
                np.save(f, np.zeros(100000))
        except WriteError as exc:
            print(exc)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        try:
            OutputLock.for_file(Path("{tmp_path}/out.npy")).acquire()
        except WriteError as exc:
            print(exc)
        print(sorted(p.name for p in Path("{tmp_path}").iterdir()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 3, out.stdout + out.stderr
    assert lines[0].startswith(f"cannot write {tmp_path}/x.npy: 100000 requested and") and "(ulimit -f)" in lines[0]
    assert lines[1] == f"cannot write {tmp_path}/.out.npy.dice-fast.lock: File too large", lines[1]
    assert lines[2] == "['x.npy']"  # no lock file left
