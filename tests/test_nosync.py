"""Packed forwards without host syncs (`dice_fast.nosync`): transformers' packed-sequence check
never runs on device data, and the vectors stay exact."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from dice_fast import DiceEncoder, nosync
from dice_fast import runner as runner_module
from dice_fast.bench.run import encode_plan
from tiny_models import tiny

TEXTS = ["alpha beta gamma delta " * 5, "one two three", "x y z w " * 9]


def forward_syncs(enc, plan) -> list:
    """Host syncs seen inside every packed forward of ``enc`` over ``plan``."""
    inner, calls = enc.runner._packed_hidden, []

    def counted(*args, **kwargs):
        with nosync.HostSyncs() as seen:
            out = inner(*args, **kwargs)
        calls.extend(seen.calls)
        return out

    with mock.patch.object(enc.runner, "_packed_hidden", counted):
        vecs = encode_plan(enc, plan)
    return calls, vecs


def test_host_syncs_sees_data_dependent_reads():
    x = torch.arange(5)
    with nosync.HostSyncs() as s:
        if (x > 2).any():
            x.sum().item()
        x.tolist()
        y = x * 2  # no read: not counted
    assert [name for name, _ in s.calls] == ["__bool__", "item", "tolist"] and y.shape == (5,)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "bert"])
def test_packed_forward_has_no_host_sync(arch):
    """Without the all-True mask, transformers' check syncs once per forward (decoders; encoders too
    from transformers 5.25), so this test fails on the old forward; with it none, and the vectors are
    the same."""
    model, tok, *_ = tiny(arch)
    enc = DiceEncoder(model, tok, chunk_size=8)
    assert enc.backend != "padded"
    plan = enc.plan(TEXTS)
    calls, vecs = forward_syncs(enc, plan)
    assert calls == []
    with mock.patch.object(runner_module, "sync_free_kwargs", lambda ids: {}):
        old_calls, old_vecs = forward_syncs(enc, plan)
    assert old_calls != [] or arch == "bert"  # encoders had no check before transformers 5.25
    np.testing.assert_allclose(vecs, old_vecs, rtol=0, atol=1e-6)


def test_sync_free_kwargs_shape():
    ids = torch.zeros(1, 7, dtype=torch.long)
    mask = nosync.sync_free_kwargs(ids)["attention_mask"]
    assert mask.shape == (1, 7) and mask.dtype == torch.bool and bool(mask.all())
