"""``dice-fast encode`` in a subprocess, stopped mid-run: SIGTERM / SIGINT leave no partial or temporary
output (one line on stderr, exit status 2), and after kill -9 ``--resume`` finishes the job with the
output of a clean run."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from corpus_util import cli_process, corpus_docs, encoder, wait_for, write_jsonl
from dice_fast.corpus import load_embeddings


def _committed(folder: Path) -> dict | None:
    try:
        m = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return m if m["shards"] else None


@pytest.mark.parametrize("sig,output", [(signal.SIGTERM, "vecs.npy"), (signal.SIGINT, "shards/")])
def test_signal_leaves_no_partial_output(tmp_path, sig, output):
    src = write_jsonl(tmp_path / "big.jsonl", corpus_docs(3000, seed=1, words=(40, 120)))
    out = tmp_path / "out"
    target = out / output
    proc = cli_process(["encode", str(src), "-o", str(target), "--id-field", "id", "-q", "--shard-rows", "4",
                        "--max-batch-tokens", "64", "--chunk-size", "30"])
    if output.endswith("/"):
        wait_for(lambda: _committed(target) is not None, proc)  # mid-run, with shards committed
    else:
        wait_for(lambda: out.exists() and any(p.name.endswith(".tmp") for p in out.iterdir()), proc)
        time.sleep(0.5)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, (proc.returncode, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dice-fast: interrupted by {sig.name}; "), stderr
    if output.endswith("/"):
        manifest = json.loads((target / "manifest.json").read_text())
        assert manifest["status"] == "running"
        assert sorted(p.name for p in target.iterdir()) == sorted(["manifest.json"] + [s["file"] for s in
                                                                                      manifest["shards"]])
        assert "continue with --resume" in lines[0]
    else:
        assert "no output written" in lines[0]
        assert not out.exists()  # the folder the job created is gone too


def test_kill_9_then_resume_equals_a_clean_run(tmp_path):
    # small windows (--max-batch-tokens 64: about 4096 characters, 10 of these documents, 3 windows in
    # all) so that shards commit one by one
    docs = corpus_docs(30, seed=2, words=(40, 60))
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    opts = ["--id-field", "id", "-q", "--shard-rows", "6", "--max-batch-tokens", "64", "--chunk-size", "30"]
    out = tmp_path / "out"
    proc = cli_process(["encode", str(src), "-o", str(out), *opts])
    wait_for(lambda: _committed(out) is not None, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "running" and 0 < manifest["rows"] < 30
    resumed = cli_process(["encode", str(src), "-o", str(out), *opts, "--resume"])
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert f"{manifest['rows']} already committed (resumed)" in stdout
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # the killed run's temporary files are gone
    ids, vecs = load_embeddings(out)
    assert ids == [f"doc{i:04d}" for i in range(30)]  # every id exactly once, in order
    clean = encoder(chunk_size=30).encode_documents(docs)  # a clean run (packing differs: float rounding)
    np.testing.assert_allclose(vecs, clean, atol=1e-5, rtol=0)
