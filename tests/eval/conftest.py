"""Shared by the evaluation tests: one tiny end-to-end `run_eval` on a passkey task."""

import pytest

from dice_fast import DiceEncoder
from dice_fast.eval.run import run_eval
from dice_fast.eval.tasks import make_passkey_task
from tiny_models import tiny


@pytest.fixture(scope="session")
def tiny_result():
    """(encoder, task, EvalResult): tiny BERT, passkey lengths 64 / 128, chunk sizes 16 / 40, hybrid alpha 0.3."""
    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, top_k=2)
    task = make_passkey_task(tok, lengths=(64, 128), docs_per_length=4, queries_per_length=3, seed=1)
    res = run_eval(task, enc, chunk_sizes=(16, 40), aggregations=("mean", "max", "topk_norm"), seed=1,
                   show_progress=False, log=None, hybrid_alphas=(0.3,))
    return enc, task, res
