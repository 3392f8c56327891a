"""Shared test set-up.

Triton kernels run on the CPU through the interpreter; TRITON_INTERPRET must be set before triton is
first imported, so it is set here, at collection time, whenever no GPU is present.

Markers: ``gpu`` tests are skipped without a CUDA device; ``slow`` tests (long load and scale runs)
are skipped unless ``DICE_FAST_SLOW=1`` is set or ``-m slow`` selects them, so the default run
(README's test command, CI) stays lean; every slow test has a bounded variant in the default run.

Timeouts (pytest-timeout): 120 s per test by default (pytest.ini); a ``slow`` test gets `SLOW_TIMEOUT`
unless it carries its own ``@pytest.mark.timeout``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# nothing in the tests may reach a model hub: a hub name must fail fast from the local cache
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

torch.manual_seed(0)

SLOW_TIMEOUT = 900  # seconds, for tests marked slow (the default, 120 s, is in pytest.ini)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped cleanly on CPU)")
    config.addinivalue_line("markers", "slow: longer end-to-end test")


def pytest_collection_modifyitems(config, items):
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    run_slow = os.environ.get("DICE_FAST_SLOW") == "1" or "slow" in (config.getoption("-m") or "")
    skip_slow = None if run_slow else pytest.mark.skip(reason="slow: set DICE_FAST_SLOW=1 to run")
    for item in items:
        # markers, not item.keywords: keywords also hold the names of the parent folders, so a checkout
        # in a folder named "gpu" or "slow" would skip every test
        if skip_gpu is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
        slow = item.get_closest_marker("slow") is not None
        if skip_slow is not None and slow:
            item.add_marker(skip_slow)
        if slow and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


@pytest.fixture
def ov_cache(tmp_path, monkeypatch):
    """A private ``DICE_FAST_CACHE_DIR`` and an empty OpenVINO model memo: a test sees only its own
    exports (int8 and float), as a new process would."""
    from dice_fast.quant import openvino as ovq

    monkeypatch.setenv("DICE_FAST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ovq, "_MEMO", type(ovq._MEMO)())
    monkeypatch.setattr(ovq, "_RECENT", type(ovq._RECENT)(maxlen=ovq._RECENT.maxlen))
    return tmp_path
