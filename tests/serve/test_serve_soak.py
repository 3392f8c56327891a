"""The soak benchmark's parts: the testing-only fault injection (a forward pre-hook raising
torch.OutOfMemoryError) and, behind the slow marker, a few seconds of the soak itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dice_fast.faults import InputOutOfMemory
from dice_fast.serve.fault_injection import inject_oom
from helpers import assert_close
from serve_testing import word_texts


def test_injected_out_of_memory_errors_fail_forwards_until_removed(tiny_encoder):
    texts = word_texts(3, 5, 40, seed=50)
    ref = tiny_encoder.encode_documents(texts)
    handle = inject_oom(tiny_encoder.model, 1.0)
    try:
        with pytest.raises(InputOutOfMemory, match="injected"):  # every forward fails, split to one chunk too
            tiny_encoder.encode_documents(texts)
    finally:
        handle.remove()
    assert_close(tiny_encoder.encode_documents(texts), ref, atol=1e-6)
    with pytest.raises(ValueError, match="fraction"):
        inject_oom(tiny_encoder.model, 1.5)


@pytest.mark.slow
def test_a_short_soak_has_no_5xx_off_the_model_and_no_wrong_vector(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import soak

    csv = tmp_path / "soak.csv"
    code = soak.main(["--duration", "5", "--capacity-seconds", "3", "--docs", "8", "--max-tokens", "256",
                      "--fault-fraction", "0.2", "--csv", str(csv)])
    assert code == 0
    assert csv.read_text().count("\n") == 2
