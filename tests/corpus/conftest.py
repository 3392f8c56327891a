"""Shared by the corpus (``dice-fast encode``) tests: one intra-op thread, and a fixture making the
command reuse encoders loaded earlier in the session."""

from __future__ import annotations

import pytest
import torch

from corpus_util import encoder


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def cached_encoders(monkeypatch):
    """Make ``dice-fast encode`` reuse encoders loaded earlier in the session with the same options
    (the model load path itself is exercised by the subprocess and error tests)."""
    import dice_fast.cliargs as cliargs

    real = cliargs.make_encoder

    def make(args):
        if args.model is not None:
            return real(args)
        opts = {k: v for k, v in cliargs.encoder_options(args).items() if v is not None}
        return encoder(**opts)

    monkeypatch.setattr(cliargs, "make_encoder", make)
