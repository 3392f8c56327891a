"""One live job per output: a second ``dice-fast encode`` on the same output (or a conflicting split of
the same folder) is refused with exit status 2 and one line naming the holder, the other split of a
folder runs beside it, and a ``kill -9``-ed holder leaves no stale lock.

The holder is a real second process reading stdin: it takes the lock before it loads the model and
reads its input, so it holds the lock, verifiably (`is_held`), until the test writes the input."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import numpy as np
import pytest

from corpus_util import cli_process, corpus_docs, encoder, wait_for
from dice_fast.cli import main
from dice_fast.corpus import load_embeddings
from dice_fast.corpus.lock import OutputLock, OutputLocked, file_lock_name, folder_lock_name, is_held


def _holder(args: list[str]) -> subprocess.Popen:
    return cli_process(["encode", "-", "--format", "txt", "-q", *args], stdin=subprocess.PIPE)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=60)


def _refused(capsys, argv: list[str], holder: subprocess.Popen) -> str:
    capsys.readouterr()
    assert main(["encode", *argv, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dice-fast: error: "), err
    assert "is locked by a running dice-fast encode" in err, err
    assert f"pid {holder.pid} on host {socket.gethostname()} since " in err, err  # the holder, by name
    return err


def test_a_live_split_holds_it_and_the_other_split_runs_beside_it(tmp_path, capsys, cached_encoders):
    docs = corpus_docs(9, seed=3)
    src = tmp_path / "d.txt"
    src.write_text("\n".join(docs) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    holder = _holder(["-o", f"{out}/", "--shard", "0/2"])
    try:
        wait_for(lambda: is_held(out / folder_lock_name(0, 2)), holder, what="the job to take its lock")
        assert main(["encode", str(src), "-o", str(out), "--shard", "1/2", "-q"]) == 0  # 1/2 beside 0/2
        before = sorted(p.name for p in out.iterdir())
        for extra in (["--shard", "0/2"], ["--shard", "0/2", "--resume"], ["--overwrite"], ["--shard", "1/3"]):
            err = _refused(capsys, [str(src), "-o", str(out), *extra], holder)
            assert "encode - --format txt -q -o" in err and "--shard 0/2" in err, err  # and its command
        assert "unsplit" not in err and "job of split 0/2" in err, err
        assert sorted(p.name for p in out.iterdir()) == before  # nothing removed, not even with --overwrite
        os.kill(holder.pid, signal.SIGKILL)  # a kill -9 leaves its lock file, but the kernel released the lock
        holder.communicate(timeout=60)
    finally:
        _stop(holder)
    assert (out / folder_lock_name(0, 2)).exists()
    assert main(["encode", str(src), "-o", str(out), "--shard", "0/2", "--resume", "-q"]) == 0
    ids, vecs = load_embeddings(out)
    assert ids == [str(i) for i in range(1, 10)]  # line numbers, the two splits interleaved
    np.testing.assert_allclose(vecs, encoder().encode_documents(docs), atol=1e-5, rtol=0)
    assert not [p for p in out.iterdir() if p.name.endswith(".lock")]  # lock files go with their jobs


def test_a_live_npy_job_holds_its_file(tmp_path, capsys, cached_encoders):
    src = tmp_path / "d.txt"
    src.write_text("one\ntwo\n", encoding="utf-8")
    out = tmp_path / "vecs.npy"
    holder = _holder(["-o", str(out)])
    try:
        wait_for(lambda: is_held(tmp_path / file_lock_name(out)), holder, what="the job to take its lock")
        _refused(capsys, [str(src), "-o", str(out), "--overwrite"], holder)
        assert main(["encode", str(src), "-o", str(tmp_path / "other.npy"), "-q"]) == 0  # another file: free
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and "vecs" not in p.name]
    finally:
        _stop(holder)
    assert main(["encode", str(src), "-o", str(out), "-q"]) == 0
    ids, vecs = load_embeddings(out)
    assert ids == ["1", "2"] and vecs.shape == (2, 384)


@pytest.mark.parametrize("first,second,conflict", [
    ((0, 1), (0, 1), True), ((0, 1), (0, 2), True), ((1, 2), (0, 1), True), ((0, 2), (0, 2), True),
    ((0, 2), (1, 3), True), ((0, 2), (1, 2), False), ((2, 3), (0, 3), False),
])
def test_which_jobs_share_a_folder(tmp_path, first, second, conflict):
    """The rule, on locks alone (flock is per open file, so one process can play both jobs): splits of
    one count coexist; an unsplit job, another count or the same split conflict; a dead job's lock
    file does not count and is tidied away."""
    with OutputLock.for_folder(tmp_path, *first):
        if conflict:
            with pytest.raises(OutputLocked, match=f"{tmp_path} is locked by a running dice-fast encode"):
                OutputLock.for_folder(tmp_path, *second).acquire()
        else:
            with OutputLock.for_folder(tmp_path, *second):
                assert is_held(tmp_path / folder_lock_name(*second))
    assert not list(tmp_path.iterdir())
    (tmp_path / folder_lock_name(*first)).write_text('{"pid": 1}\n', encoding="utf-8")  # left by a kill -9
    with OutputLock.for_folder(tmp_path, *second):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ([] if conflict else [folder_lock_name(*first)])


def test_a_symbolic_link_or_fifo_in_a_lock_files_place_is_refused_untouched(tmp_path):
    """A lock file is opened without following links: a link planted where the lock goes (pointing at a
    file the job must not truncate) is refused by name and its target is left as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / folder_lock_name(0, 1)).symlink_to(victim)
    with pytest.raises(ValueError, match=r"\.dice-fast\.lock is a symbolic link"):
        OutputLock.for_folder(out).acquire()
    assert victim.read_text() == "precious\n"
    (out / folder_lock_name(0, 1)).unlink()
    (out / folder_lock_name(0, 2)).symlink_to(victim)  # a rival's place: read for its holder, not followed
    with pytest.raises(ValueError, match=r"\.dice-fast-0of2\.lock is a symbolic link"):
        OutputLock.for_folder(out).acquire()
    (out / folder_lock_name(0, 2)).unlink()
    single = tmp_path / "vecs.npy"
    os.mkfifo(tmp_path / file_lock_name(single))  # would block an open that waits for a writer
    with pytest.raises(ValueError, match="not a regular file"):
        OutputLock.for_file(single).acquire()
    assert victim.read_text() == "precious\n"


def test_another_users_lock_file_is_locked_but_not_rewritten(tmp_path, monkeypatch):
    """A lock file left by another user's dead job is locked as it is (its content stays)."""
    left = tmp_path / folder_lock_name(0, 1)
    left.write_text('{"pid": 1, "host": "elsewhere"}\n')
    monkeypatch.setattr(os, "getuid", lambda: os.stat(left).st_uid + 1)  # the file is now someone else's
    with OutputLock.for_folder(tmp_path) as lock:
        assert is_held(left) and left.read_text() == '{"pid": 1, "host": "elsewhere"}\n'
        monkeypatch.undo()
        with pytest.raises(OutputLocked, match="pid 1 on host elsewhere"):
            OutputLock.for_folder(tmp_path).acquire()
    assert lock.fd is None
    with OutputLock.for_folder(tmp_path):  # this user's own: rewritten with this job's name
        assert f'"pid": {os.getpid()}' in left.read_text()


@pytest.mark.parametrize("suffix", [".npy", ".parquet"])
def test_an_output_name_near_the_file_name_limit_is_written(tmp_path, capsys, cached_encoders, suffix):
    """A 244-byte name (the most a file name holds is 255) was refused, "File name too long", naming
    its lock file (16 bytes more) or temporary (14 more), never the output itself: both are named from
    a digest of it there, and a killed job's temporaries are still found by that name."""
    from dice_fast.corpus.outputs import file_temps

    src = tmp_path / "d.txt"
    src.write_text("one\ntwo\n", encoding="utf-8")
    out = tmp_path / ("a" * (244 - len(suffix)) + suffix)
    assert len(out.name.encode()) == 244 and len(file_lock_name(out).encode()) < 255
    leftover = tmp_path / f".{file_lock_name(out)[1:-len('.dice-fast.lock')]}.0123abcd.tmp"
    leftover.write_bytes(b"a killed job's")
    assert file_temps(out) == [leftover]
    assert main(["encode", str(src), "-o", str(out), "-q"]) == 0
    assert load_embeddings(out)[1].shape == (2, 384)
    assert not leftover.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    too_long = tmp_path / ("b" * 248 + ".npy")  # its ids file would be b...b.ids.txt, 256 bytes
    capsys.readouterr()
    assert main(["encode", str(src), "-o", str(too_long), "-q"]) == 2
    assert "an .npy name holds at most 251 bytes" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("b", ".b", ".~"))]
