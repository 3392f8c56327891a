"""Shared test set-up.

Triton kernels run on the CPU through the interpreter; TRITON_INTERPRET must be set before triton is
first imported, so it is set here, at collection time, whenever no GPU is present.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.manual_seed(0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped cleanly on CPU)")
    config.addinivalue_line("markers", "slow: longer end-to-end test")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
