"""Data shipped with the package: real English prose (CPython's reference text, PSF licence) used by
the needle task and by the benchmark corpora (`prose_documents`)."""

from pathlib import Path

PROSE_PATH = Path(__file__).with_name("prose.txt")


def prose() -> str:
    """The bundled prose: paragraphs separated by one blank line."""
    return PROSE_PATH.read_text(encoding="utf-8")


def prose_documents(tokenizer, lengths, seed: int = 0) -> list[str]:
    """Documents of real prose cut at token boundaries to ``lengths`` (n_docs,) tokens each of
    ``tokenizer`` (a fast Hugging Face tokenizer), drawn reproducibly from ``seed``."""
    import numpy as np

    text = prose().replace("\n\n", " ")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets = np.asarray(enc["offset_mapping"])
    n = len(offsets)
    rng = np.random.default_rng(seed + 1)
    docs = []
    for length in lengths:
        parts, need = [], int(length)
        while need > 0:
            take = min(need, n)
            s = int(rng.integers(0, n - take + 1))
            parts.append(text[offsets[s][0] : offsets[s + take - 1][1]])
            need -= take
        docs.append(" ".join(parts))
    return docs
