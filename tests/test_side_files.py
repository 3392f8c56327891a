"""Files replaced whole or not at all, and the names of the hidden files beside them."""

import threading

from dice_fast.side_files import NAME_MAX, new_temp, replace_file, side_stem, temp_stem


def test_replace_file_writes_whole_or_keeps_the_old_file(tmp_path):
    """`dice-fast eval` wrote its report in place: under a full disk (a file size limit here) the good
    report became a cut-off one. Now the old file stays and no temporary is left."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "report.md").write_text("the good report\n")
    code = textwrap.dedent(f"""
        import resource
        from dice_fast.side_files import replace_file
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
        try:
            replace_file("{tmp_path}/report.md", b"x" * 5000)
        except OSError as exc:
            print(type(exc).__name__, exc.errno, open("{tmp_path}/report.md").read().split()[1])
        replace_file("{tmp_path}/report.md", b"the new report\\n")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["OSError", "27", "good"], out.stdout + out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]
    assert (tmp_path / "report.md").read_text() == "the new report\n"


def test_replace_file_takes_text_and_leaves_no_temporary_across_threads(tmp_path):
    """The CPU tuning cache was written by many threads at once: each needs its own temporary, and the
    file read back is always one writer's whole text."""
    path = tmp_path / "cache.json"
    texts = [f"writer {i} " * 200 for i in range(8)]
    threads = [threading.Thread(target=replace_file, args=(path, t)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_text(encoding="utf-8") in texts
    assert [p.name for p in tmp_path.iterdir()] == ["cache.json"]


def test_side_names_fit_one_file_name(tmp_path):
    """An output named with up to 255 bytes gets temporaries and locks beside it: a name too long for
    ``.NAME.XXXXXXXX.tmp`` is replaced by its digest, the same each time (a later run finds them)."""
    short, long = "out.parquet", "é" * 120 + ".parquet"  # 248 bytes
    assert temp_stem(short) == short and side_stem(short, 20) == short
    assert temp_stem(long) == temp_stem(long) != long and temp_stem(long).startswith("~")
    tmp = new_temp(tmp_path, long)
    assert len(tmp.name.encode()) <= NAME_MAX and tmp.name.startswith(f".{temp_stem(long)}.")
    assert tmp.stat().st_size == 0 and new_temp(tmp_path, long) != tmp
