"""The CPU heap policy (`dice_fast.cpu_heap`): activation pages are reused between operations instead
of being handed back to the OS and faulted in again, and the policy changes no vector.

Each case runs in a fresh interpreter: glibc's thresholds are per process and cannot be unset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Build a CPU encoder (which sets the policy) and encode a few documents; then run forward-shaped
# allocation cycles (two 25 MB and four 6.25 MB activations, as in one MiniLM layer at 4096 tokens,
# all freed at the end) and count minor page faults: over ten cycles after three warm ones, and over
# one cycle after `release_freed_memory` handed the pages back (which shows the count sees re-faults).
_SCRIPT = r"""
import json, resource, sys
import numpy as np, torch
sys.path.insert(0, "tests")
from tiny_models import tiny
from dice_fast import DiceEncoder, cpu_heap
model, tokenizer, *_ = tiny("bert")
enc = DiceEncoder(model, tokenizer, chunk_size=16)
np.save(sys.argv[1], enc.encode_documents(["the cat sat on a mat " * n for n in (1, 5, 20)]))

def cycle():
    held = [torch.empty(6_553_600).fill_(1.0) for _ in range(2)] + [torch.empty(1_638_400).fill_(1.0) for _ in range(4)]
    del held

def faults(cycles):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(cycles):
        cycle()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults(3)
steady = faults(10)
cpu_heap.release_freed_memory()
print(json.dumps(dict(steady=steady, after_release=faults(1), applied=cpu_heap.keep_freed_pages())))
"""
PAGES_PER_CYCLE = (2 * 6_553_600 + 4 * 1_638_400) * 4 // 4096


def _run(tmp_path: Path, mode: str | None) -> tuple[dict, np.ndarray]:
    env = {k: v for k, v in os.environ.items() if k != "DICE_FAST_CPU_HEAP"}
    if mode is not None:
        env["DICE_FAST_CPU_HEAP"] = mode
    out = tmp_path / f"{mode}.npy"
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), np.load(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap policy")
def test_kept_pages_are_reused_released_on_request_and_change_no_vector(tmp_path):
    kept, kept_vecs = _run(tmp_path, None)  # the default: keep
    default, default_vecs = _run(tmp_path, "default")
    assert kept["applied"] and not default["applied"]
    # re-faulted every cycle would be >= 10 cycles of pages (glibc's own policy: 0.1-3.3 cycles'
    # worth over ten cycles, varying with the heap's layout); kept: at most some growth, once
    assert kept["steady"] < 2 * PAGES_PER_CYCLE, kept
    assert default["steady"] >= kept["steady"], (default, kept)
    assert kept["after_release"] > PAGES_PER_CYCLE // 2, kept  # handed back: the next cycle faults them in
    np.testing.assert_array_equal(kept_vecs, default_vecs)


def test_bad_setting_is_named(monkeypatch):
    from dice_fast import cpu_heap

    monkeypatch.setenv("DICE_FAST_CPU_HEAP", "off")
    monkeypatch.setattr(cpu_heap, "_applied", None)
    with pytest.raises(ValueError, match="DICE_FAST_CPU_HEAP='off'.*'keep'.*'default'"):
        cpu_heap.keep_freed_pages()


def test_the_heap_is_trimmed_after_windows_that_ran_enough_tokens_to_matter(monkeypatch):
    """After each window of a CPU encode the freed pages go back to the OS, but not after a window of
    fewer than SMALL_WINDOW_TOKENS tokens run (a query, a short document: a trim cost 2 % of such a call,
    and such a window leaves little to hand back); `release_freed_memory()` alone always trims."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import WORDS, tiny

    from dice_fast import DiceEncoder, cpu_heap

    model, tok = tiny("bert")[:2]
    enc = DiceEncoder(model, tok, chunk_size=32, device="cpu", dedup=False)  # (sets the real policy first)
    trims = []

    class Libc:
        def malloc_trim(self, pad):
            trims.append(pad)

    monkeypatch.setattr(cpu_heap, "_libc", Libc)
    cpu_heap.release_freed_memory()
    cpu_heap.release_freed_memory(cpu_heap.SMALL_WINDOW_TOKENS)
    cpu_heap.release_freed_memory(cpu_heap.SMALL_WINDOW_TOKENS - 1)
    assert len(trims) == 2
    trims.clear()
    enc.encode_queries(["a short query"])
    enc.encode_documents([" ".join(WORDS[:40])])
    assert trims == []
    long = " ".join(WORDS[i % len(WORDS)] for i in range(cpu_heap.SMALL_WINDOW_TOKENS + 100))
    enc.encode_documents([long])  # one window over the threshold
    assert trims == [0]
