"""Helpers of the corpus tests: cached encoders, a small deterministic corpus, the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

_ENCODERS: dict = {}
ROOT = Path(__file__).resolve().parents[2]


def encoder(**options):
    """The bundled model with ``options``, loaded once per session."""
    from dice_fast import DiceEncoder

    key = json.dumps(options, sort_keys=True)
    if key not in _ENCODERS:
        _ENCODERS[key] = DiceEncoder.from_pretrained(**options)
    return _ENCODERS[key]


def corpus_docs(n: int, seed: int = 0, words: tuple[int, int] = (3, 60)) -> list[str]:
    """``n`` deterministic documents of ``words`` words (a few thousand distinct words)."""
    import random

    rng = random.Random(seed)
    vocab = [f"{a}{b}" for a in ("alpha", "beta", "gamma", "delta", "omega", "sigma") for b in
             ("river", "stone", "cloud", "field", "light", "house", "tree", "song")]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(*words))) for _ in range(n)]


def write_jsonl(path: Path, docs: list[str], ids: list[str] | None = None) -> Path:
    ids = ids or [f"doc{i:04d}" for i in range(len(docs))]
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in zip(ids, docs)), encoding="utf-8")
    return path


def interrupted_copy(ref: Path, out: Path, shards: int = 2) -> list[str]:
    """``out``: the shard folder ``ref`` as a job interrupted after its first ``shards`` shards left it
    (those shards, and a manifest listing only them, status "running"); returns its file names."""
    out.mkdir()
    manifest = json.loads((ref / "manifest.json").read_text())
    for s in manifest["shards"][:shards]:
        (out / s["file"]).write_bytes((ref / s["file"]).read_bytes())
    manifest.update(status="running", shards=manifest["shards"][:shards])
    (out / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return sorted(p.name for p in out.iterdir())


def cli_process(args: list[str], **kwargs) -> subprocess.Popen:
    """``python -m dice_fast.cli ARGS`` in a new process (one intra-op thread), pipes for its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "dice_fast.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0, what: str = "the job to start encoding") -> None:
    """Poll ``predicate`` until true; fail (with the process's output) if ``proc`` ends first or after
    ``timeout`` seconds."""
    import pytest

    t0 = time.monotonic()
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the job ended (status {proc.returncode}) before the test could stop it:\n{out}\n{err}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)
