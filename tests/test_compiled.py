"""The compiled packed forward (`dice_fast.compiled`): exact against the per-chunk oracle, one graph
with no graph break across batch sizes, compile time reported, the padded fallback refused."""

from __future__ import annotations

import pytest
import torch

from dice_fast import DiceEncoder
from oracle import check, corpus
from tiny_models import tiny


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_compiled_matches_oracle_in_one_graph(arch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # the oracle's corpus in 40-token batches: token counts, chunk counts and runs of equal lengths
    # vary from batch to batch, and one batch holds a single run
    enc, _ = check(arch, texts=corpus() + corpus(seed=3, longest=90), compile="on")
    assert enc.runner.compiled is not None
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # one dynamic graph: no recompile for a new batch size
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert f"compiled in {enc.runner.compiled.compile_seconds:.1f} s" in repr(enc)


def test_single_run_batches_share_the_graph():
    """A batch of equal-length chunks (one run) and one of many lengths reuse the first graph."""
    from torch._dynamo.utils import counters

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=8, max_batch_tokens=64, compile="on", pooling_impl="torch")
    before = counters["stats"]["unique_graphs"]
    eager = DiceEncoder(model, tok, chunk_size=8, max_batch_tokens=64, pooling_impl="torch")
    for texts in (["the cat sat on a mat and dog ran"] * 5, [" ".join(["sky"] * n) for n in (1, 3, 9, 17, 30)]):
        got, want = enc.encode_documents(texts), eager.encode_documents(texts)
        assert abs(got - want).max() < 1e-5
    assert counters["stats"]["unique_graphs"] == before


def test_padded_fallback_is_refused():
    model, tok, *_ = tiny("mpnet")
    with pytest.raises(ValueError, match="padded"):
        DiceEncoder(model, tok, chunk_size=8, compile="on")
    with pytest.raises(ValueError, match="compile"):
        DiceEncoder(model, tok, chunk_size=8, compile="yes")
