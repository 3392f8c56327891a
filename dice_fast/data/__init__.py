"""Data shipped with the package: real English prose (CPython's reference text, PSF licence) used by
the needle task and by the benchmark corpora (`prose_documents`)."""

from pathlib import Path

from ..errors import InputError

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


def prose_halves() -> tuple[list[str], list[str]]:
    """The bundled prose's paragraphs split in two: (first half, second half). The int8 path
    calibrates on the first (`dice_fast.quant`); agreement is measured on the second, never seen
    in calibration."""
    paragraphs = [p for p in prose().split("\n\n") if p.strip()]
    half = len(paragraphs) // 2
    return paragraphs[:half], paragraphs[half:]


def token_windows(tokenizer, text: str, n: int, tokens: int) -> list[str]:
    """``n`` pieces of ``text``, each exactly the characters of ``tokens`` consecutive tokens of
    ``tokenizer``, starting at word starts spread evenly over the text (overlapping when the text
    holds fewer than ``n`` x ``tokens`` tokens). Raises ValueError if ``text`` is shorter than ``tokens``."""
    import numpy as np

    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets = np.asarray(enc["offset_mapping"])
    last = len(offsets) - tokens  # the latest start with room for a whole window
    if last < 0 or n < 1 or tokens < 1:
        raise InputError(f"need n >= 1 windows of tokens >= 1 within {len(offsets)} tokens of text; "
                         f"got n={n}, tokens={tokens}")
    starts = offsets[: last + 1, 0]
    word = np.flatnonzero((starts == 0) | np.array([text[max(s - 1, 0)].isspace() for s in starts]))
    picks = word[np.linspace(0, len(word) - 1, n).round().astype(np.int64)]
    return [text[offsets[s][0] : offsets[s + tokens - 1][1]] for s in picks]
