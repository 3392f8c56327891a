"""Bench tests: tiny models on the CPU run in one intra-op thread (restored afterwards).

On the shared 2-core machine, two threads on these tiny matmuls lose far more to contention than
they gain: one baseline/engine call took 2.4 s with 2 threads and 0.05 s with 1 under load 4-5.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
