"""Serving tests: the real bundled model (loaded once) and a tiny BERT with small chunks and a small
token budget, so that documents span several batches and requests share them."""

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="the serve extra is not installed")

from dice_fast import DiceEncoder  # noqa: E402
from tiny_models import tiny  # noqa: E402


@pytest.fixture(scope="session")
def real_encoder():
    """The bundled all-MiniLM-L6-v2 on the CPU, float32."""
    return DiceEncoder.from_pretrained(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_encoder():
    """A tiny random BERT: 16-token chunks (18 with [CLS]/[SEP]), 128-token batches."""
    model, tokenizer, *_ = tiny("bert")
    return DiceEncoder(model, tokenizer, chunk_size=16, max_batch_tokens=128)
